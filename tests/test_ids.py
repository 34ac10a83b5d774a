from apps.runs.ids import parse_run_id, public_run_id


def test_public_ids_round_trip():
    for pk in [1, 31, 32, 1023, 41877, 2**40 + 7]:
        assert parse_run_id(public_run_id(pk)) == pk


def test_foreign_ids_are_not_parsed():
    for raw in ["", "run_", "job_12", "run_!!", "run_" + "Z" * 40, "12"]:
        assert parse_run_id(raw) is None
