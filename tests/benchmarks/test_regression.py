"""The regression check says which ratios moved, and which way."""

import json

from benchmarks import regression


def run_with(**ratios):
    return {"name": "demo", "ratios": {k: {"value": v[0], "goal": v[1]} for k, v in ratios.items()}}


def test_ratios_are_compared_with_a_tolerance_and_against_their_goals():
    old = run_with(steady=(1.0, None), faster=(1.0, None), slower=(2.0, None), lost=(2.1, 2.0), gone=(1.0, None))
    new = run_with(steady=(1.1, None), faster=(1.5, None), slower=(1.0, None), lost=(1.95, 2.0), fresh=(3.0, None))
    verdicts = {m.label: m.verdict for m in regression.compare(new, old, tolerance=0.2)}
    assert verdicts == {"steady": "steady", "faster": "better", "slower": "worse", "lost": "worse", "gone": "gone",
                        "fresh": "new"}


def test_the_command_exits_1_when_something_got_worse(tmp_path, capsys):
    (tmp_path / "old.json").write_text(json.dumps(run_with(a=(2.0, None))))
    (tmp_path / "new.json").write_text(json.dumps(run_with(a=(1.0, None))))
    assert regression.main([str(tmp_path / "new.json"), "--against", str(tmp_path / "old.json")]) == 1
    assert "worse  a: 2.000 -> 1.000 (-50%)" in capsys.readouterr().out
    (tmp_path / "same.json").write_text(json.dumps(run_with(a=(2.1, None))))
    assert regression.main([str(tmp_path / "same.json"), "--against", str(tmp_path / "old.json")]) == 0
    assert regression.main([str(tmp_path / "missing.json")]) == 2


def test_an_agreement_ratio_is_worse_as_it_drifts_from_one_either_way():
    def agreements(**values):
        return {"name": "demo", "ratios": {k: {"value": v, "goal": None, "kind": "agreement"}
                                           for k, v in values.items()}}

    old = agreements(up=1.0, down=1.0, back=1.2, still=1.001)
    new = agreements(up=1.25, down=0.75, back=1.0, still=1.002)
    verdicts = {m.label: m.verdict for m in regression.compare(new, old)}
    assert verdicts == {"up": "worse", "down": "worse", "back": "better", "still": "steady"}
