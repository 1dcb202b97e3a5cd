"""bench/step_anatomy.py's pure parts: the FLOPs it counts per phase and the tables it prints (the
runs themselves are the bench's job: minutes of CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


@pytest.fixture
def anatomy(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the bench imports its siblings as top-level modules
    for name in ("step_anatomy", "grpo_step_vs_trl", "update_bound"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import step_anatomy

    return step_anatomy


def test_step_flops_count_each_phase_by_hand(anatomy):
    # One linear layer 4 -> 6, hidden 4, vocab 10, one layer; one sample of 2 prompt + 1 response tokens.
    shape = anatomy.ModelShape(linears=((4, 6),), hidden=4, vocab=10, layers=1)
    flops = anatomy.step_flops(shape, prompts=[2], responses=[1], decode_rows=1)
    linear, head, attention = 2 * 3 * 4 * 6, 2 * 1 * 4 * 10, 2 * 1 * 3 * 3 * 4  # 3 tokens, 1 scored row
    assert flops.total("gen") == linear + head + attention
    assert flops.total("old_log_prob") == flops.total("ref") == linear + head + attention
    # The update: forward + a backward of twice it; the head forward, recompute and two gradients.
    assert flops.total("update_actor") == 3 * (linear + attention) + 4 * head


def test_capping_a_gemms_rows_keeps_its_flops(anatomy):
    shape = anatomy.ModelShape(linears=((8, 8), (8, 16)), hidden=8, vocab=32, layers=2)
    prompts, responses = [5, 7, 9, 3], [4, 1, 6, 2]
    whole = anatomy.step_flops(shape, prompts, responses, decode_rows=4)
    capped = anatomy.step_flops(shape, prompts, responses, decode_rows=4, max_rows=3)
    for phase in ("gen", "ref", "update_actor"):
        assert capped.total(phase) == pytest.approx(whole.total(phase))
        assert max(m for m, *_ in capped.gemms[phase]) <= 3
    # Generation's decoder GEMMs run at the decode batch's width, the others over every token.
    assert {m for m, *_ in whole.gemms["gen"]} == {4}
    assert whole.gemms["ref"][0][0] == sum(prompts) + sum(responses)


def test_tables_print_dashes_for_what_was_not_measured_and_trl_over_ours(anatomy):
    table = anatomy.step_table("run", [("gen+reward", 1.5, 0.5, 2.0, 0.25, 0.9), ("verify", 0.01, None, None, None, None)])
    lines = table.splitlines()
    assert lines[2].split() == ["gen+reward", "1.500", "0.500", "2.00", "0.25", "0.90"]
    assert lines[3].split() == ["verify", "0.010", "-", "-", "-", "-"]
    ours = {"steps": [{"step": 2.0, "gen": 0.5, "cpu_s": {"step": 1.0, "gen": 0.25}}], "peak_rss_gb": 1.0}
    trl = {"steps": [{"step": 10.0, "gen": 4.0, "cpu": 6.0, "gen_cpu": 2.0}], "peak_rss_gb": 4.0}
    rows = {line.split()[0]: line.split() for line in anatomy.versus_trl("ours", ours, trl).splitlines()[2:]}
    assert rows["generation"][-2:] == ["8.00", "8.00"]  # wall 4 / 0.5, CPU 2 / 0.25
    assert rows["whole"][-2:] == ["5.00", "6.00"]
    assert rows["peak"][-1] == "0.25)"  # ours / TRL
