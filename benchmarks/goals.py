"""The benchmarks' goals: each a column of the rows it applies to, with what it checks and its
verdict there (reported, never asserted). A goal is set for the working shapes of its benchmark; at
--quick's tiny shapes fixed costs (dispatch, threads starting, allocation) dominate the times, so a
quick run reports its figures and judges no goal."""

UNJUDGED = "goals not judged: --quick runs tiny shapes, where fixed costs dominate the times"


def judge(rows: list, goals: dict, quick: bool) -> list:
    """Writes each goal's verdict (True / False) into the rows it applies to, and returns rows.
    goals: column -> (what it checks, met(row): True, False, or None where the goal does not apply
    to the row). A quick run judges none."""
    if not quick:
        for row in rows:
            for column, (_, met) in goals.items():
                verdict = met(row)
                if verdict is not None:
                    row[column] = verdict
    return rows


def described(goals: dict, quick: bool) -> dict:
    """The JSON's "goals": column -> what it checks; a quick run's say they were not judged."""
    return {column: f"{what} ({UNJUDGED})" if quick else what for column, (what, _) in goals.items()}


def print_verdicts(rows: list, goals: dict, quick: bool):
    """Each goal in words: MET where every row that judges it meets it, NOT MET, or not judged (a
    quick run, or no row it applies to)."""
    if quick:
        print(UNJUDGED)
        return
    for column, (what, _) in goals.items():
        verdicts = [row[column] for row in rows if column in row]
        state = "NOT JUDGED" if not verdicts else "MET" if all(verdicts) else "NOT MET"
        print(f"{state}: {what} ({sum(verdicts)} of {len(verdicts)} rows)")


def judged_columns(rows: list, goals: dict) -> list:
    """The goal columns some row has a verdict in (none after a quick run), for the tables."""
    return [column for column in goals if any(column in row for row in rows)]
