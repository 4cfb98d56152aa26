// Full-vocabulary divergences between a student's and a teacher's softmax, per-row math shared by
// the CPU and CUDA kernels. The GEMMs give both models' raw logits over the same vocab rows; each
// model's softmax takes z = map(x), its own logit map (vocab_parallel/logit_map.h). With q the
// student's probabilities and p the teacher's:
//   forward_kl = KL(p || q) = sum p (log p - log q)
//   reverse_kl = KL(q || p) = sum q (log q - log p)
//   jsd = beta KL(p || M) + (1 - beta) KL(q || M),  M = beta p + (1 - beta) q.
// Per model, over the vocabulary seen so far, the kernels keep (a Side)
//   m = max z,  s = sum exp(z - m),  c = sum exp(z - m) (z - z_other)
// (z_other: the other model's logit of the same token), which merge exactly across vocab chunks and
// TP ranks, as m moves (both sums scale by exp(m_old - m_new)). With lse = m + log s,
//   forward_kl = c_t / s_t - (lse_t - lse_s),  reverse_kl = c_s / s_s - (lse_s - lse_t),
// so the KL divergences take one pass. jsd needs both lse first: a second pass sums
// p (log p - log M) and q (log q - log M) (mixture_add), whose sums the ranks add.
// Gradients in the student's logits (the teacher's are constants), per token u:
//   forward_kl: q_u - p_u
//   reverse_kl: q_u (log q_u - log p_u - reverse_kl)
//   jsd: (1 - beta) q_u (log q_u - log M_u - KL(q || M)).
// Logits are kept relative to each model's row max (log q = z - m - log s), as chosen_logprob does.
//
// Non-finite logits: a NaN in either model's row makes its max NaN and so the row's divergence and
// gradients NaN. A token of probability 0 (a -inf logit, or one far below its row's max) adds
// nothing to a model's sums (0 log 0 = 0, and no 0 * inf), so a -inf teacher logit leaves the
// teacher's sums finite, while a student -inf logit where the teacher has mass makes forward_kl
// +inf, as float64 gives. A Side with no mass (padding, or every logit -inf) is marked by max = -inf
// with s = c = 0; merges skip it by that mark, never by its sums (a NaN sum must propagate).
#pragma once

#include <type_traits>

#include "common/math.h"
#include "vocab_parallel/logit_map.h"
#include "vocab_parallel/softmax_partial.h"

namespace fused_rl_ops::vocab_divergence {

enum class Kind : int { forward_kl = 0, reverse_kl = 1, jsd = 2 };

// The columns of a token's row of stats (a vocab shard's partials, both models' Sides), of what
// combine_row makes of the shards' partials, and of the jsd pass's sums.
namespace stats_column {
enum : int { student_max, student_sum, student_cross, teacher_max, teacher_sum, teacher_cross, count };
}
namespace combined_column {
enum : int { student_max, student_log_sum, teacher_max, teacher_log_sum, forward_kl, reverse_kl, count };
}
namespace mixture_column {
enum : int { teacher, student, count };  // sum p (log p - log M), sum q (log q - log M)
}

// A softmax partial (vocab_parallel/softmax_partial.h: partial_empty, partial_merge via side_merge).
template <typename T>
struct Side {
  T max;    // m; -inf while empty
  T sum;    // s
  T cross;  // c
};

// Adds one token to a model's sums against its row max m: z its logit, other the other model's.
template <typename T>
FRL_HD void side_add(T z, T other, T m, T& s, T& c) {
  const T e = Math<T>::exp(z - m);
  const auto no_mass = (z == T(-INFINITY)) | (e == T(0));
  s = s + Math<T>::select(no_mass, T(0), e);
  c = c + Math<T>::select(no_mass, T(0), e * (z - other));
}

// Adds n tokens to a model's Side in one pass over them (the online softmax): its max is first
// raised to the largest of their logits z, both sums scaled by exp(m_old - m_new) (an empty Side's
// are 0 and stay so; a NaN reaches both), then each token is added against it (side_add). other: the
// other model's logits of the same tokens.
template <typename T, int n>
FRL_HD void side_add_online(Side<T>& side, const T (&z)[n], const T (&other)[n]) {
  T m = side.max;
  for (int i = 0; i < n; ++i) m = Math<T>::max(m, z[i]);
  if (!(m == side.max)) {
    const T a = Math<T>::exp(side.max - m);
    side.sum = a * side.sum;
    side.cross = a * side.cross;
    side.max = m;
  }
  for (int i = 0; i < n; ++i) side_add(z[i], other[i], side.max, side.sum, side.cross);
}

// Merges b into a at the larger max (partial_merge). An empty b changes nothing; any NaN reaches the
// result.
template <typename T>
FRL_HD void side_merge(Side<T>& a, const Side<T>& b) {
  partial_merge(a, b, [&](T m) {
    const T ea = Math<T>::exp(a.max - m), eb = Math<T>::exp(b.max - m);
    a.sum = ea * a.sum + eb * b.sum;
    a.cross = ea * a.cross + eb * b.cross;
    a.max = m;
  });
}

// Merges one chunk's Sides into a token's row of stats.
template <typename T>
FRL_HD void stats_update_row(T* row, const Side<T>& student, const Side<T>& teacher) {
  Side<T> s{row[stats_column::student_max], row[stats_column::student_sum], row[stats_column::student_cross]};
  Side<T> t{row[stats_column::teacher_max], row[stats_column::teacher_sum], row[stats_column::teacher_cross]};
  side_merge(s, student);
  side_merge(t, teacher);
  row[stats_column::student_max] = s.max;
  row[stats_column::student_sum] = s.sum;
  row[stats_column::student_cross] = s.cross;
  row[stats_column::teacher_max] = t.max;
  row[stats_column::teacher_sum] = t.sum;
  row[stats_column::teacher_cross] = t.cross;
}

// Token r of partials [ranks, N, stats_column::count] -> row r of out (combined_column).
template <typename T>
FRL_HD void combine_row(const T* partials, int64_t ranks, int64_t N, int64_t r, T* out) {
  Side<T> s = partial_empty<Side<T>>(), t = partial_empty<Side<T>>();
  for (int64_t k = 0; k < ranks; ++k) {
    const T* q = partials + (k * N + r) * stats_column::count;
    side_merge(s, Side<T>{q[stats_column::student_max], q[stats_column::student_sum], q[stats_column::student_cross]});
    side_merge(t, Side<T>{q[stats_column::teacher_max], q[stats_column::teacher_sum], q[stats_column::teacher_cross]});
  }
  const T ls = Math<T>::log(s.sum), lt = Math<T>::log(t.sum);
  T* o = out + r * combined_column::count;
  o[combined_column::student_max] = s.max;
  o[combined_column::student_log_sum] = ls;
  o[combined_column::teacher_max] = t.max;
  o[combined_column::teacher_log_sum] = lt;
  o[combined_column::forward_kl] = t.cross / t.sum - (t.max - s.max) - (lt - ls);
  o[combined_column::reverse_kl] = s.cross / s.sum - (s.max - t.max) - (ls - lt);
}

// A token row's merged constants as the element formulas take them (in T: a scalar or a vector).
template <typename T>
struct RowConstants {
  T student_max, student_log_sum, teacher_max, teacher_log_sum;
  T term;  // the divergence's row term of the gradient (Params::row_term)
};

// jsd's weights in T, from beta taken in double: log beta, log(1 - beta) and 1 - beta.
template <typename T>
struct MixtureWeights {
  T log_beta, log_one_minus_beta, one_minus_beta;

  FRL_HD static MixtureWeights of(double beta) {
    return {T(::log(beta)), T(::log1p(-beta)), T(1.0 - beta)};
  }
  template <typename V>
  FRL_HD MixtureWeights<V> as() const {
    return {V(log_beta), V(log_one_minus_beta), V(one_minus_beta)};
  }
};

// log(exp(a) + exp(b)); NaN where both are -inf (only for tokens of no mass, which pass nothing).
template <typename T>
FRL_HD T log_add_exp(T a, T b) {
  const T top = Math<T>::max(a, b);
  return top + Math<T>::log(T(1) + Math<T>::exp(T(0) - Math<T>::abs(a - b)));
}

// log M of a token, from log q and log p.
template <typename T>
FRL_HD T log_mixture(T log_q, T log_p, const MixtureWeights<T>& w) {
  return log_add_exp(w.log_beta + log_p, w.log_one_minus_beta + log_q);
}

// Adds one token to jsd's sums: kt += p (log p - log M), ks += q (log q - log M).
template <typename T>
FRL_HD void mixture_add(T zs, T zt, const RowConstants<T>& row, const MixtureWeights<T>& w, T& kt, T& ks) {
  const T log_q = zs - row.student_max - row.student_log_sum, log_p = zt - row.teacher_max - row.teacher_log_sum;
  const T log_m = log_mixture(log_q, log_p, w);
  const T p = Math<T>::exp(log_p), q = Math<T>::exp(log_q);
  kt = kt + Math<T>::select(p == T(0), T(0), p * (log_p - log_m));
  ks = ks + Math<T>::select(q == T(0), T(0), q * (log_q - log_m));
}

// d(divergence) / dz_s of one token (module comment), before the upstream gradient and the slope of
// the student's logit map. A token of student probability 0 passes none (its log-ratio may be inf).
template <Kind kKind, typename T>
FRL_HD T student_logit_grad(T zs, T zt, const RowConstants<T>& row, const MixtureWeights<T>& w) {
  const T log_q = zs - row.student_max - row.student_log_sum, log_p = zt - row.teacher_max - row.teacher_log_sum;
  const T q = Math<T>::exp(log_q);
  if constexpr (kKind == Kind::forward_kl) {
    return q - Math<T>::exp(log_p);
  } else if constexpr (kKind == Kind::reverse_kl) {
    return Math<T>::select(q == T(0), T(0), q * (log_q - log_p - row.term));
  } else {
    const T log_m = log_mixture(log_q, log_p, w);
    return Math<T>::select(q == T(0), T(0), w.one_minus_beta * q * (log_q - log_m - row.term));
  }
}

// Calls fn with the kind as a compile-time constant (std::integral_constant<Kind, ...>).
template <class Fn>
void with_kind(int kind, const Fn& fn) {
  switch (static_cast<Kind>(kind)) {
    case Kind::forward_kl: fn(std::integral_constant<Kind, Kind::forward_kl>{}); break;
    case Kind::reverse_kl: fn(std::integral_constant<Kind, Kind::reverse_kl>{}); break;
    case Kind::jsd: fn(std::integral_constant<Kind, Kind::jsd>{}); break;
  }
}

}  // namespace fused_rl_ops::vocab_divergence
