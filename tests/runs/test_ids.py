from apps.runs.ids import parse_run_id, public_run_id


def test_public_ids_round_trip():
    for pk in [1, 31, 32, 1023, 41877, 2**40 + 7]:
        assert parse_run_id(public_run_id(pk)) == pk
        assert parse_run_id(public_run_id(pk).lower()) == pk


def test_foreign_ids_are_not_parsed():
    for raw in [
        *["", "run_", "job_12", "run_!!", "run_" + "Z" * 40, "12", None, 12],
        # Not Crockford digits: I, L, O, U, and what int(..., 32) alone would take.
        *["run_1I", "run_L", "run_o", "run_U", "run_-1", "run_+1", "run_1_0", "run_ 1", "run_1\n"],
        # Letters that case-fold to ASCII ones: the long s and the Kelvin sign.
        *["run_\u017f", "run_\u212a", "run_\u00df"],
    ]:
        assert parse_run_id(raw) is None
