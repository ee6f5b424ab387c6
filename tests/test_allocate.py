"""tools.allocate: the greedy spends the budget where the modelled KL falls most per bit, and never over it."""
import itertools

import pytest

from vq_gguf.tools.allocate import greedy, tensor_configs

BITS = [1.75, 2.0, 2.25, 3.0]


def modelled(s: float) -> list[float]:
    return [s * 1.4 ** -(4 * (b - 2)) for b in BITS]    # error ×1.4 per quarter bit less


def test_greedy_gives_the_bits_to_the_sensitive_tensor_and_stays_in_budget():
    kl = {"blk.0.ffn_down": modelled(0.04), "blk.1.ffn_down": modelled(0.01), "blk.2.ffn_down": modelled(0.01)}
    bits = {n: BITS for n in kl}
    weights = {n: 100 for n in kl}
    rung = greedy(kl, bits, weights, budget=2.0)
    assert sum(BITS[r] for r in rung.values()) / 3 <= 2.0
    assert BITS[rung["blk.0.ffn_down"]] > 2.0 > min(BITS[rung["blk.1.ffn_down"]], BITS[rung["blk.2.ffn_down"]])
    # no other choice within the budget has a lower total (exhaustive over the 64 choices)
    best = min(sum(kl[n][r] for n, r in zip(kl, rs)) for rs in itertools.product(range(4), repeat=3)
               if sum(BITS[r] for r in rs) / 3 <= 2.0)
    assert sum(kl[n][r] for n, r in rung.items()) == pytest.approx(best)


def test_greedy_refuses_a_budget_below_the_cheapest_rung():
    with pytest.raises(SystemExit, match="over the budget"):
        greedy({"blk.0.ffn_down": modelled(0.01)}, {"blk.0.ffn_down": BITS}, {"blk.0.ffn_down": 10}, budget=1.5)


def test_tensor_configs_group_blocks_by_kind_and_rung():
    rung = {"blk.11.ffn_down": 2, "blk.1.ffn_down": 2, "blk.3.ffn_down": 0, "blk.3.attn_v": 2}
    assert tensor_configs(rung, ["v=4,k=128", "v=4,k=256", "v=4,k=512"]) == [
        "attn_v@3:v=4,k=512", "ffn_down@3:v=4,k=128", "ffn_down@1,11:v=4,k=512"]


def test_tensor_configs_are_what_quantize_applies():
    import dataclasses

    from vq_gguf.cli import parse_tensor_config
    from vq_gguf.presets import PRESETS
    preset = PRESETS["2bit"]
    rung = {f"blk.{b}.ffn_down": r for b, r in [(0, 2), (1, 0), (2, 1), (29, 2)]}
    args = tensor_configs(rung, ["v=4,k=128", "v=4,k=256", "v=2,k=64"])
    preset = dataclasses.replace(preset, overrides=tuple(parse_tensor_config(a, preset.config) for a in args) + preset.overrides)
    got = {b: preset.config_for(f"blk.{b}.ffn_down.weight", 30) for b in (0, 1, 2, 29)}
    assert [(got[b].v, got[b].k) for b in (0, 1, 2, 29)] == [(2, 64), (4, 128), (4, 256), (2, 64)]


def test_bad_paths_and_files_are_refused_clearly(tmp_path):
    from vq_gguf.tools.allocate import main
    with pytest.raises(SystemExit, match="no such file"):
        main([str(tmp_path / "missing.gguf"), "--sensitivity", "s.json", "--budget", "2", "--ladder", "v=4,k=256"])
    (tmp_path / "f.gguf").write_bytes(b"")
    (tmp_path / "s.json").write_text("{}")
    with pytest.raises(SystemExit, match="not the JSON"):
        main([str(tmp_path / "f.gguf"), "--sensitivity", str(tmp_path / "s.json"), "--budget", "2", "--ladder", "v=4,k=256"])
