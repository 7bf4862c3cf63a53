"""oomdoctor check: the CI gate's decisions, formats and determinism."""
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from oomdoctor.plans.check import ConfigError, load_config
from oomdoctor.cli import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, cli

ROOT = os.path.dirname(os.path.dirname(__file__))
MLP = os.path.join(ROOT, "sample_models", "tiny_mlp.py")


def write_config(tmp_path, extra=""):
    cfg = tmp_path / "setup.cfg"
    cfg.write_text(f"""
[oomdoctor]
baseline = base.json
tolerance = 2%

[oomdoctor:mlp-fp32]
model = {MLP}
batch_size = 64
gpu = rtx3090

[oomdoctor:mlp-bf16]
model = {MLP}
batch_size = 128
precision = bf16
gpu = a100-40
{extra}
""")
    return str(cfg)


def run(*args):
    return CliRunner().invoke(cli, ["check", "-j", "1", *args])


def test_update_then_pass(tmp_path):
    cfg = write_config(tmp_path)
    res = run("--config", cfg, "--update")
    assert res.exit_code == EXIT_OK, res.output
    doc = json.loads((tmp_path / "base.json").read_text())
    assert doc["schema"] == 1 and doc["torch_version"] and doc["oomdoctor_version"]
    assert set(doc["cases"]) == {"mlp-fp32", "mlp-bf16"}
    res = run("--config", cfg)
    assert res.exit_code == EXIT_OK
    assert "passed: 2 of 2" in res.stdout


def test_regression_improvement_and_tolerance(tmp_path):
    cfg = write_config(tmp_path)
    run("--config", cfg, "--update")
    base = tmp_path / "base.json"
    doc = json.loads(base.read_text())
    # Pretend the baseline was 10% smaller for one case and 10% larger for the other.
    doc["cases"]["mlp-fp32"]["peak_reserved_bytes"] = int(
        doc["cases"]["mlp-fp32"]["peak_reserved_bytes"] / 1.10)
    doc["cases"]["mlp-bf16"]["peak_reserved_bytes"] = int(
        doc["cases"]["mlp-bf16"]["peak_reserved_bytes"] * 1.10)
    base.write_text(json.dumps(doc))
    res = run("--config", cfg, "--json")
    assert res.exit_code == EXIT_PROBLEM
    rows = {r["case"]: r for r in json.loads(res.stdout)["cases"]}
    assert rows["mlp-fp32"]["status"] == "regression"
    assert rows["mlp-fp32"]["change"] == pytest.approx(0.10, abs=1e-4)
    assert rows["mlp-bf16"]["status"] == "improvement" and "--update" in rows["mlp-bf16"]["message"]
    # A tolerance above the growth lets it pass.
    assert run("--config", cfg, "--tolerance", "15%").exit_code == EXIT_OK


def test_fails_closed_on_a_broken_model_and_on_missing_baseline(tmp_path):
    cfg = write_config(tmp_path, f"""
[oomdoctor:broken]
model = {os.path.join(ROOT, 'tests', 'bad_models', 'item_call.py')}
batch_size = 2
""")
    res = run("--config", cfg, "--json")
    assert res.exit_code == EXIT_PROBLEM
    out = json.loads(res.stdout)
    rows = {r["case"]: r for r in out["cases"]}
    assert rows["broken"]["status"] == "error" and "data" in rows["broken"]["message"]
    assert rows["mlp-fp32"]["status"] == "new"          # no baseline yet: never a silent pass
    assert any("no baseline" in n for n in out["notes"])
    # --update refuses to record a baseline with a broken case.
    res = run("--config", cfg, "--update")
    assert res.exit_code == EXIT_PROBLEM and "broken" in res.stderr


def test_budget(tmp_path):
    cfg = write_config(tmp_path, f"""
[oomdoctor:mlp-tight]
model = {MLP}
batch_size = 65536
budget = 1GiB
margin = 5%
""")
    run("--config", cfg, "--update")
    res = run("--config", cfg, "--json")
    rows = {r["case"]: r for r in json.loads(res.stdout)["cases"]}
    # 1 GiB card minus the rtx3090 profile's 400 MiB context and a 5% margin leaves ~573 MiB;
    # batch 65536 of tiny_mlp keeps 65536 x 256 x 4 B = 64 MiB of input and, per hidden layer,
    # 65536 x 512 x 4 B = 128 MiB for each of the Linear and ReLU outputs: well over that.
    assert rows["mlp-tight"]["status"] == "budget"
    assert res.exit_code == EXIT_PROBLEM


def test_stale_config_and_torch_version_change(tmp_path):
    cfg = write_config(tmp_path)
    run("--config", cfg, "--update")
    base = tmp_path / "base.json"
    doc = json.loads(base.read_text())
    doc["torch_version"] = "1.13.1"
    doc["cases"]["mlp-fp32"]["config"]["batch_size"] = 32
    base.write_text(json.dumps(doc))
    res = run("--config", cfg, "--json")
    out = json.loads(res.stdout)
    assert out["torch_version_changed"] is True
    assert any("torch changed" in n for n in out["notes"])
    assert {r["case"]: r["status"] for r in out["cases"]}["mlp-fp32"] == "stale"
    assert res.exit_code == EXIT_PROBLEM


def test_github_annotations_and_junit(tmp_path):
    cfg = write_config(tmp_path)
    run("--config", cfg, "--update")
    base = tmp_path / "base.json"
    doc = json.loads(base.read_text())
    doc["cases"]["mlp-fp32"]["peak_allocated_bytes"] //= 2
    base.write_text(json.dumps(doc))
    junit = tmp_path / "junit.xml"
    res = run("--config", cfg, "--format", "github", "--junit-xml", str(junit))
    assert res.exit_code == EXIT_PROBLEM
    first = res.stdout.splitlines()[0]
    assert first.startswith(f"::error file={MLP},title=oomdoctor mlp-fp32: regression::")
    suite = ET.parse(junit).getroot()
    assert suite.get("tests") == "2" and suite.get("failures") == "1"
    failed = [tc.get("name") for tc in suite.iter("testcase") if tc.find("failure") is not None]
    assert failed == ["mlp-fp32"]


def test_deterministic_across_processes(tmp_path):
    """Two separate processes write byte-identical baselines."""
    cfg = write_config(tmp_path)
    outs = []
    for i in range(2):
        subprocess.run([sys.executable, "-m", "oomdoctor", "check", "--config", cfg, "--update",
                        "-j", "1"], check=True, capture_output=True, cwd=ROOT)
        outs.append((tmp_path / "base.json").read_bytes())
    assert outs[0] == outs[1]


@pytest.mark.parametrize("body,message", [
    ("[oomdoctor:x]\nbatch_size = 2\n", "needs `model"),
    (f"[oomdoctor:x]\nmodel = {MLP}\nbatch_size = 2\nprecison = fp16\n", "unknown key"),
    (f"[oomdoctor:x]\nmodel = {MLP}\nbatch_size = 2\nprecision = fp8\n", "precision"),
    (f"[oomdoctor:x]\nmodel = {MLP}\nbatch_size = 2\ngpu = gtx480\n", "unknown GPU"),
    (f"[oomdoctor:x]\nmodel = {MLP}\nbatch_size = 2\nbudget = 24GB\n", "ambiguous"),
    ("[oomdoctor]\ntolerance = 2%\n", "no \\[oomdoctor:NAME\\] sections"),
])
def test_config_errors(tmp_path, body, message):
    f = tmp_path / "c.cfg"
    f.write_text(body)
    with pytest.raises(ConfigError, match=message):
        load_config(str(f))
    res = run("--config", str(f))
    assert res.exit_code == EXIT_USAGE


def test_the_projects_own_config_loads():
    cfg = load_config(os.path.join(ROOT, "setup.cfg"))
    assert len(cfg.cases) >= 7 and os.path.exists(os.path.join(cfg.root, cfg.baseline))


def test_setup_cfg_survives_setuptools_interpolation():
    """setuptools reads setup.cfg with %-interpolation: a bare `2%` there breaks
    `pip install -e .` on a fresh machine. The project's own file must parse, and doubled
    percent signs are accepted."""
    from setuptools.config.setupcfg import read_configuration

    from oomdoctor.plans.check import _fraction
    assert read_configuration(os.path.join(ROOT, "setup.cfg"))["metadata"]["name"] == "oomdoctor"
    assert _fraction("2%%", "tolerance") == pytest.approx(0.02)
    assert _fraction("0.02", "tolerance") == pytest.approx(0.02)


def test_a_pure_fp16_case_on_a_card_without_bf16(tmp_path):
    """precision = fp16-pure in setup.cfg, gated on a T4: estimated (fp16 weights, 2 bytes per
    parameter, so less than the same case in fp32) and passed against its baseline."""
    cfg = write_config(tmp_path, f"""
[oomdoctor:mlp-fp16-pure]
model = {MLP}
batch_size = 64
precision = fp16-pure
gpu = t4

[oomdoctor:mlp-fp32-t4]
model = {MLP}
batch_size = 64
gpu = t4
""")
    assert run("--config", cfg, "--update").exit_code == EXIT_OK
    cases = json.loads((tmp_path / "base.json").read_text())["cases"]
    pure, fp32 = cases["mlp-fp16-pure"], cases["mlp-fp32-t4"]
    # tiny_mlp: 399,370 parameters; fp32 holds 16 bytes of model states each, fp16-pure 8
    assert 0 < pure["peak_allocated_bytes"] <= fp32["peak_allocated_bytes"] - 8 * 399_370
    res = run("--config", cfg)
    assert res.exit_code == EXIT_OK and "passed: 4 of 4" in res.stdout
