"""The main job runs in the simulated world and every step matches the dense tensor."""
import subprocess
import sys


def test_demo_cli_matches_dense():
    out = subprocess.run([sys.executable, "-m", "shardtensor", "demo"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all steps match the dense tensor" in out.stdout
    assert "all_to_all" in out.stdout and "reduce_scatter" in out.stdout
    assert "MISMATCH" not in out.stdout
