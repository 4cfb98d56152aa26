// vocab_divergence's CPU row kernels: SIMD (at::vec) runs of the shared formulas of
// vocab_divergence/math.h, compiled once per ISA (common/cpu_isa.h); no torch header but at::vec.
#include <utility>

#include "common/vec_math.h"
#include "vocab_divergence/cpu_rows.h"
#include "vocab_divergence/math.h"

namespace fused_rl_ops::vocab_divergence::CPU_CAPABILITY {
namespace {

// Calls fn(zero, student map, teacher map) in acc = decltype(zero), double where fp64, else float
// (vocab_parallel/logit_map.h's PlainLogit or SoftcappedLogit each).
template <class Fn>
void with_logit_maps(const Params& p, bool fp64, const Fn& fn) {
  with_acc_logit_map(p.logit_map, fp64, [&](auto zero, const auto& student) {
    with_logit_map<decltype(zero)>(p.teacher_logit_map, [&](const auto& teacher) { fn(zero, student, teacher); });
  });
}

template <typename acc>
acc row_max(const acc* x, int64_t C) {
  using Vec = at::vec::Vectorized<acc>;
  const int64_t C_vec = C - C % Vec::size();
  Vec vmax(-INFINITY);
  for (int64_t k = 0; k < C_vec; k += Vec::size()) vmax = Math<Vec>::max(vmax, Vec::loadu(x + k));
  acc m = horizontal_max(vmax);
  for (int64_t k = C_vec; k < C; ++k) m = Math<acc>::max(m, x[k]);
  return m;
}

template <typename acc>
RowConstants<acc> row_constants(const Params& p, int64_t r) {
  const auto* row = static_cast<const acc*>(p.row) + r * combined_column::count;
  const auto* term = static_cast<const acc*>(p.row_term);
  return {row[combined_column::student_max], row[combined_column::student_log_sum], row[combined_column::teacher_max],
          row[combined_column::teacher_log_sum], term ? term[r] : acc(0)};
}

template <typename V, typename acc>
RowConstants<V> as_vec(const RowConstants<acc>& c) {
  return {V(c.student_max), V(c.student_log_sum), V(c.teacher_max), V(c.teacher_log_sum), V(c.term)};
}

template <typename acc, class Student, class Teacher>
void stats_rows_cpu(const Params& p, const Student& student, const Teacher& teacher) {
  using Vec = at::vec::Vectorized<acc>;
  const auto *xs = static_cast<const acc*>(p.logits), *xt = static_cast<const acc*>(p.teacher_logits);
  auto* stats = static_cast<acc*>(p.stats);
  const int64_t C = p.cols, C_vec = C - C % Vec::size();
  const auto vstudent = student.template as<Vec>();
  const auto vteacher = teacher.template as<Vec>();
  for (int64_t r = 0; r < p.rows; ++r) {
    const acc *s = xs + r * C, *t = xt + r * C;
    // The maps are nondecreasing: a row's largest z is the map of its largest x.
    const acc ms = student(row_max(s, C)), mt = teacher(row_max(t, C));
    const Vec vms(ms), vmt(mt);
    Vec ss(0), cs(0), st(0), ct(0);
    for (int64_t k = 0; k < C_vec; k += Vec::size()) {
      const Vec zs = vstudent(Vec::loadu(s + k)), zt = vteacher(Vec::loadu(t + k));
      side_add(zs, zt, vms, ss, cs);
      side_add(zt, zs, vmt, st, ct);
    }
    Side<acc> a{ms, horizontal_sum(ss), horizontal_sum(cs)}, b{mt, horizontal_sum(st), horizontal_sum(ct)};
    for (int64_t k = C_vec; k < C; ++k) {
      const acc zs = student(s[k]), zt = teacher(t[k]);
      side_add(zs, zt, ms, a.sum, a.cross);
      side_add(zt, zs, mt, b.sum, b.cross);
    }
    stats_update_row(stats + r * stats_column::count, a, b);
  }
}

// A pass over the merged rows (mixture and gradient): its logit maps and mixture weights as scalars
// (a row's tail) and as vectors (its SIMD body).
template <typename acc, class Student, class Teacher>
struct MergedRows {
  using Vec = at::vec::Vectorized<acc>;
  const Params& p;
  const Student& student;
  const Teacher& teacher;
  const decltype(std::declval<const Student&>().template as<Vec>()) vstudent = student.template as<Vec>();
  const decltype(std::declval<const Teacher&>().template as<Vec>()) vteacher = teacher.template as<Vec>();
  const MixtureWeights<acc> weights = MixtureWeights<acc>::of(p.beta);
  const MixtureWeights<Vec> vweights = weights.template as<Vec>();
  const int64_t C_vec = p.cols - p.cols % Vec::size();

  // fn(r, s, t, row, vrow) for every token row r: s and t its student's and teacher's raw logits, row
  // its merged constants (row_constants) and vrow those as vectors.
  template <class Fn>
  void for_each(const Fn& fn) const {
    const auto *xs = static_cast<const acc*>(p.logits), *xt = static_cast<const acc*>(p.teacher_logits);
    for (int64_t r = 0; r < p.rows; ++r) {
      const RowConstants<acc> row = row_constants<acc>(p, r);
      fn(r, xs + r * p.cols, xt + r * p.cols, row, as_vec<Vec>(row));
    }
  }
};

template <typename acc, class Student, class Teacher>
void mixture_rows_cpu(const Params& p, const Student& student, const Teacher& teacher) {
  using Vec = at::vec::Vectorized<acc>;
  auto* sums = static_cast<acc*>(p.mixture);
  const MergedRows<acc, Student, Teacher> m{p, student, teacher};
  m.for_each([&](int64_t r, const acc* s, const acc* t, const auto& row, const auto& vrow) {
    Vec kt(0), ks(0);
    for (int64_t k = 0; k < m.C_vec; k += Vec::size()) {
      mixture_add(m.vstudent(Vec::loadu(s + k)), m.vteacher(Vec::loadu(t + k)), vrow, m.vweights, kt, ks);
    }
    acc teacher_sum = horizontal_sum(kt), student_sum = horizontal_sum(ks);
    for (int64_t k = m.C_vec; k < p.cols; ++k) {
      mixture_add(student(s[k]), teacher(t[k]), row, m.weights, teacher_sum, student_sum);
    }
    acc* out = sums + r * mixture_column::count;
    out[mixture_column::teacher] += teacher_sum;
    out[mixture_column::student] += student_sum;
  });
}

// Into p.grads (acc; may be p.logits itself: each element is read before it is overwritten).
template <Kind kKind, typename acc, class Student, class Teacher>
void grad_rows_cpu(const Params& p, const Student& student, const Teacher& teacher) {
  using Vec = at::vec::Vectorized<acc>;
  const auto* g = static_cast<const acc*>(p.grad);
  auto* grads = static_cast<acc*>(p.grads);
  const MergedRows<acc, Student, Teacher> m{p, student, teacher};
  m.for_each([&](int64_t r, const acc* s, const acc* t, const auto& row, const auto& vrow) {
    acc* d = grads + r * p.grads_stride;
    const Vec vg(g[r]);
    for (int64_t k = 0; k < m.C_vec; k += Vec::size()) {
      const Vec x = Vec::loadu(s + k);
      const Vec dz = student_logit_grad<kKind>(m.vstudent(x), m.vteacher(Vec::loadu(t + k)), vrow, m.vweights);
      (dz * vg * m.vstudent.slope(x)).store(d + k);
    }
    for (int64_t k = m.C_vec; k < p.cols; ++k) {
      d[k] = student_logit_grad<kKind>(student(s[k]), teacher(t[k]), row, m.weights) * g[r] * student.slope(s[k]);
    }
  });
}

void stats_rows(const Params& p, bool fp64) {
  with_logit_maps(p, fp64, [&](auto zero, const auto& s, const auto& t) { stats_rows_cpu<decltype(zero)>(p, s, t); });
}

void mixture_rows(const Params& p, bool fp64) {
  with_logit_maps(p, fp64,
                  [&](auto zero, const auto& s, const auto& t) { mixture_rows_cpu<decltype(zero)>(p, s, t); });
}

void grad_rows(const Params& p, bool fp64) {
  with_kind(p.kind, [&](auto kind) {
    with_logit_maps(p, fp64, [&](auto zero, const auto& s, const auto& t) {
      grad_rows_cpu<decltype(kind)::value, decltype(zero)>(p, s, t);
    });
  });
}

}  // namespace

const RowKernels row_kernels{&stats_rows, &mixture_rows, &grad_rows};

}  // namespace fused_rl_ops::vocab_divergence::CPU_CAPABILITY
