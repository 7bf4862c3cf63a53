"""The transformers support matrix: every Hugging Face architecture the tests cover, on tiny
configs built in code, with and without an attention mask, traced and checked against a real
CPU run of the same two training steps (tests/reference.py), on whichever transformers is
installed.

The matrix is this file run on each release: the one setup.cfg's ``test`` extra installs (the
full suite), and the oldest declared one, which .ci/run installs into a second virtualenv:

    python3 -m venv /tmp/tf && /tmp/tf/bin/pip install torch==2.13.0 && \
    /tmp/tf/bin/pip install transformers==4.40.2 click tabulate nvidia-ml-py accelerate pytest && \
    PYTHONPATH=.:tests/_site /tmp/tf/bin/python -m pytest -m hf_releases

(4.46.3, a middle release, passes the same way.) What failed on older releases and is fixed at
the mechanism: transformers 4.x asks ``pad_token_id in input_ids[:, [-1, 0]]`` when a batch has
no mask (``warn_if_padding_and_no_attention_mask``: a tensor made from a Python list, followed
by oomdoctor.sim.values.Calls), OPT's LayerDrop asks ``torch.rand([]) < layerdrop`` (random
factories get values), and LLaMA/GPT-NeoX rotary embeddings open
``torch.autocast(device_type="meta", enabled=False)`` (oomdoctor.sim.emulate.autocast_on_meta).

Measured (simulated vs real CPU peak, batch 2, 64 tokens, fp32): within 0.006% on 4.40.2,
4.46.3 and 5.24.0 for all 14 rows; the 84-264 bytes are torch.tensor() scalars (see
tests/test_trace.py).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from oomdoctor.cli import EXIT_OK, cli
from oomdoctor.models.loader import load_model_file
from oomdoctor.sim.trace import TraceConfig, trace_training
from reference import real_cpu_peak

pytestmark = [pytest.mark.hf_releases,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers not installed (pip install oomdoctor[hf])")]
MODEL = Path(__file__).resolve().parent / "models" / "hf_arch.py"
ARCHS = ["llama", "gpt2", "opt", "gpt_neox", "bert", "distilbert", "albert"]


def arch_file(tmp_path: Path, arch: str, mask: bool) -> str:
    text = MODEL.read_text()
    assert 'ARCH = "opt"' in text and "MASK = True" in text
    out = tmp_path / f"hf_{arch}_{'mask' if mask else 'nomask'}.py"
    out.write_text(text.replace('ARCH = "opt"', f'ARCH = "{arch}"')
                   .replace("MASK = True", f"MASK = {mask}"))
    return str(out)


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "no-mask"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_trace_matches_a_real_cpu_run(tmp_path, arch, mask):
    path = arch_file(tmp_path, arch, mask)
    sim = trace_training(load_model_file(path), TraceConfig(2, emulate_cuda=False))
    real = real_cpu_peak(path, 2)
    assert abs(sim.peak_live_bytes - real) <= 0.01 * real, (arch, mask, sim.peak_live_bytes, real)


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "no-mask"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_cuda_estimate_runs_and_names_the_release(tmp_path, arch, mask):
    """The estimate users get (meta device, CUDA emulation, fp16 autocast) on the same model:
    exit 0 and the transformers release it traced."""
    import transformers
    path = arch_file(tmp_path, arch, mask)
    r = CliRunner().invoke(cli, ["estimate", path, "-b", "2", "--gpu", "rtx3090",
                                 "--precision", "fp16", "--json"])
    assert r.exit_code == EXIT_OK, r.output
    out = json.loads(r.stdout)
    assert out["peak_allocated_bytes"] > out["parameter_bytes"]
    assert out["traced_with"]["transformers"] == transformers.__version__


def _real_loop_keeping_outputs(path: str, batch_size: int) -> int:
    """Peak of a real CPU run of the loop users write: ``outputs = model(**batch); loss =
    outputs.loss; loss.backward(); step(); zero_grad()`` with no ``del outputs, loss``, two
    steps, measured by torch.profiler (tests/reference.py)."""
    import torch
    from reference import _profiled_peak, load
    mod = load(path)
    torch.manual_seed(0)
    model = mod.build_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run():
        for _ in range(2):
            batch = mod.make_batch(batch_size)
            outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            del batch
            opt.step()
            opt.zero_grad(set_to_none=True)
        return outputs, loss                 # alive to the end, as in the loop
    return _profiled_peak(model, run)


@pytest.mark.parametrize("arch", ["opt", "bert"])
def test_keep_outputs_matches_a_real_loop_that_keeps_them(tmp_path, arch):
    """--keep-outputs: last step's logits (and a decoder's returned key/value cache) live
    through the next forward. The same loop run for real on the CPU is the reference; without
    the option the trace is lower by what the note says the kept outputs hold."""
    from oomdoctor.models.loader import load_model
    path = arch_file(tmp_path, arch, True)
    kept = trace_training(load_model(path, keep_outputs=True), TraceConfig(2, emulate_cuda=False))
    real = _real_loop_keeping_outputs(path, 2)
    assert abs(kept.peak_live_bytes - real) <= 0.01 * real, (arch, kept.peak_live_bytes, real)
    plain = trace_training(load_model(path), TraceConfig(2, emulate_cuda=False))
    logits = 2 * 64 * 512 * 4                       # (B, T, V) fp32, kept from step 1
    assert kept.peak_live_bytes - plain.peak_live_bytes >= logits
    assert any(n.startswith("outputs kept") for n in kept.notes)
