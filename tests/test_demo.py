"""The main job (`shardtensor demo`: FSDP x TP training) and the placement tour run and match dense."""
import subprocess
import sys

import pytest


def test_demo_trains_and_matches_single_device(tmp_path):
    png = tmp_path / "placements.png"
    out = subprocess.run([sys.executable, "-m", "shardtensor", "demo", "--steps", "4", "--png", str(png)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "losses match single-device training" in out.stdout
    assert out.stdout.count("single-device") >= 4  # a progress line per step
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert kind in out.stdout
    assert "blocks.0.attn.q.weight" in out.stdout and "S(0)" in out.stdout
    assert png.exists() and png.stat().st_size > 1000


def test_demo_decreases_the_loss():
    from shardtensor.examples.tiny_lm import Config, reference_losses

    losses = reference_losses(Config(steps=6))
    assert losses[-1] < losses[0]


def test_tour_cli_matches_dense():
    out = subprocess.run([sys.executable, "-m", "shardtensor", "tour"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all steps match the dense tensor" in out.stdout
    assert "all_to_all" in out.stdout and "reduce_scatter" in out.stdout
    assert "MISMATCH" not in out.stdout


@pytest.mark.main_release  # a gloo repeat of simulated-world tests that run on every release
@pytest.mark.timeout(400)
def test_demo_gloo_processes():
    out = subprocess.run([sys.executable, "-m", "shardtensor", "demo", "--backend", "gloo", "--steps", "2"],
                         capture_output=True, text=True, timeout=380)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "losses match single-device training" in out.stdout and "4 gloo processes" in out.stdout
