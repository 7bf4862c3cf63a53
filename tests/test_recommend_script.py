"""`oomdoctor recommend -- python train.py` (issue #32: "your script stops at one GPU"): a
single-GPU training script as it is, planned on two GPUs. Its precision and checkpointing are
its own; the strategy, micro-batch and accumulation are searched. Every plan must be the
answer `parallel` gives for the same script at that micro-batch (one configuration, one
answer), and the largest that fits: one divisor more does not."""
import json
import os

import pytest
from click.testing import CliRunner

from oomdoctor.cli import cli

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = ["python", os.path.join(HERE, "scripts", "mlp_loop.py"), "--samples", "8192",
          "--epochs", "1"]
# a card whose allocator budget holds micro-batches in the thousands, not the whole target
CARD = ["--memory", "480MiB", "--num-gpus", "2", "--link", "pcie"]
TARGET = 4096


def _run(*args):
    r = CliRunner().invoke(cli, list(args))
    return r


@pytest.fixture(scope="module")
def plan():
    r = _run("recommend", *CARD, "--target-batch", str(TARGET), "--json", "--", *SCRIPT)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _parallel_peak(strategy: str, batch: int) -> tuple[bool, int]:
    """(fits, fullest GPU's peak) of `parallel -b batch --strategy` for the script, with the
    allocator setting recommend plans and launches with."""
    r = _run("parallel", *CARD[:2], "--gpus", "2", "--strategy", strategy, "-b", str(batch),
             "--alloc-conf", "expandable_segments:True", "--json", "--", *SCRIPT)
    assert r.exit_code in (0, 1), r.output
    [e] = json.loads(r.stdout)["strategies"]
    return e["fits"], max(g["device_peak_bytes"] for g in e["gpus"])


def test_the_plan_keeps_the_scripts_precision_and_reaches_the_target(plan):
    assert plan["precision"] == "fp32" and plan["checkpointing"] is False
    assert plan["best"] is not None and plan["candidates"][0] == plan["best"]
    for c in plan["candidates"]:
        data_parallel = c["num_gpus"] if c["strategy"] not in ("single", "pipeline2") else 1
        assert c["micro_batch"] * c["grad_accum"] * data_parallel == TARGET
        assert c["micro_batch"] < TARGET          # the budget, not the target, sets it
    assert {s["strategy"] for s in plan["skipped"]} == {"dp"}


def test_every_plan_is_what_parallel_says_and_the_largest_that_fits(plan):
    for c in plan["candidates"]:
        fits, peak = _parallel_peak(c["strategy"], c["micro_batch"])
        assert fits and peak == c["peak_device_bytes"], c
        if c == plan["best"] or c["strategy"] == "zero3":       # the next divisor does not
            data_parallel = 2 if c["strategy"] not in ("single", "pipeline2") else 1
            larger = c["micro_batch"] * 2
            assert (TARGET // data_parallel) % larger == 0
            assert not _parallel_peak(c["strategy"], larger)[0], (c["strategy"], larger)


def test_text_says_what_to_change_in_the_script(plan):
    r = _run("recommend", *CARD, "--target-batch", str(TARGET), "--", *SCRIPT)
    best = plan["best"]
    assert r.exit_code == 0
    assert f"RECOMMENDED: {best['strategy']} x{best['num_gpus']}" in r.stdout
    assert f"micro-batch {best['micro_batch']}: every DataLoader's batch_size" in r.stdout
    assert "the script's own choice" in r.stdout


def test_what_a_script_decides_itself_is_refused():
    for extra in (("--precision", "bf16"), ("--smoke",)):
        r = _run("recommend", *CARD, *extra, "--", *SCRIPT)
        assert r.exit_code == 2, r.output


def test_no_plan_asks_for_more_samples_than_the_data_has():
    """A micro-batch above the dataset's size gets the same batch as a smaller one (its run
    copies no more input): not a plan, so the plans stay within the 1000 samples."""
    small = SCRIPT[:3] + ["1000"] + SCRIPT[4:]
    r = _run("recommend", "--gpu", "rtx3090", "--num-gpus", "2", "--target-batch", "4096",
             "--json", "--", *small)
    assert r.exit_code == 0, r.output
    assert all(c["micro_batch"] <= 1000 for c in json.loads(r.stdout)["candidates"])


def test_a_script_whose_batch_cannot_be_set_is_refused_with_the_fix():
    """loop.py makes its batches itself (no DataLoader): without {batch} every run would be at
    its own batch, and the plan's micro-batch a fiction."""
    loop = ["python", os.path.join(HERE, "scripts", "loop.py"), "--model",
            os.path.join(HERE, "models", "deep_mlp.py")]
    r = _run("recommend", "--gpu", "rtx3090", "--num-gpus", "2", "--target-batch", "16", "--",
             *loop, "--batch-size", "4")
    assert r.exit_code == 3 and "{batch}" in r.output
    r = _run("recommend", "--gpu", "rtx3090", "--num-gpus", "2", "--target-batch", "16",
             "--json", "--", *loop, "--batch-size", "{batch}")
    assert r.exit_code == 0 and json.loads(r.stdout)["best"]["micro_batch"] == 16


@pytest.mark.parametrize("text,kind,words", [
    ("from accelerate import Accelerator\naccelerator = Accelerator()\n", "accelerate",
     "accelerate launch --multi_gpu --num_processes 2"),
    ("from transformers import Trainer\ntrainer = Trainer(model=model)\n", "hf_trainer",
     "torchrun --nproc_per_node 2"),
    ("import lightning as L\ntrainer = L.Trainer(max_epochs=1)\n", "lightning",
     "strategy='ddp'"),
    ("from torch.nn.parallel import DistributedDataParallel as DDP\nmodel = DDP(model)\n",
     "own_ddp", "wraps DistributedDataParallel itself"),
    ("model = Net().cuda()\n", "plain", "wrap the model in DistributedDataParallel"),
])
def test_the_ddp_advice_fits_the_scripts_framework(text, kind, words):
    """`recommend -- script` told every public example to wrap its model in DDP by hand,
    including accelerate's (launched by `accelerate launch`) and nanoGPT (which wraps DDP itself
    under torchrun). The advice follows what the script is written with."""
    from oomdoctor.plans.recommend import script_advice
    assert script_advice.framework(text) == kind
    assert words in script_advice.change("ddp", kind, 2, "train.py")
