"""One set of assumptions across the planning commands, and the smaller wrong answers of issue
#32: the precision preference, the samples/s column, DeepSpeed's estimator kept to the runs it
describes, and the host memory a LoRA smoke needs."""
import dataclasses
import json
import os

from click.testing import CliRunner

from oomdoctor.cli import cli
from oomdoctor.configs import PRECISION_PREFERENCE
from oomdoctor.models.adapters import Adapters
from oomdoctor.models.loader import load_model_file
from oomdoctor.plans.recommend.records import Candidate
from oomdoctor.plans.recommend.render import _rate
from oomdoctor.plans.recommend.search import rank
from oomdoctor.runs.smoke import SmokeConfig, host_bytes_needed
from tiny_configs import LLAMA_26M, config_folder

HERE = os.path.dirname(__file__)
DEEP = os.path.join(HERE, "models", "deep_mlp.py")


def _candidate(precision: str, peak: int) -> Candidate:
    return Candidate("zero3", 2, precision, True, 2, 64, 256, peak, (peak, peak), 779.3, 700.0,
                     79.3, 0.33, "", 779.3)


def test_a_tie_goes_to_bf16_as_probe_recommends_it():
    """fp16 AMP and bf16 AMP step alike on a 3090; recommend used to pick fp16 by 10 MiB of
    headroom where probe picks bf16. Both now follow configs.PRECISION_PREFERENCE."""
    ranked = rank([_candidate("fp16", 19 * 2**30), _candidate("bf16", 19 * 2**30 + 10 * 2**20)])
    assert ranked[0].precision == "bf16"
    assert PRECISION_PREFERENCE.index("bf16") < PRECISION_PREFERENCE.index("fp16")


def test_samples_per_second_keeps_three_digits():
    assert _rate(0.3285) == "0.329" and _rate(1.234) == "1.23" and _rate(12345.6) == "12,346"


def test_deepspeed_estimator_only_for_full_training(tmp_path):
    """DeepSpeed's 18-bytes-per-parameter estimator assumes every parameter is trained; a LoRA
    run's zero3 row does not quote it, a full run's does."""
    def zero3(*extra):
        r = CliRunner().invoke(cli, ["parallel", DEEP, "--gpus", "2", "-b", "8", "--strategy",
                                     "zero3", "--gpu", "rtx3090", "--json", *extra])
        assert r.exit_code == 0, r.output
        [e] = json.loads(r.stdout)["strategies"]
        return e
    assert zero3()["deepspeed_bytes"] is not None
    assert zero3("--lora", "4")["deepspeed_bytes"] is None


def test_a_lora_smoke_needs_the_frozen_weights_only():
    """The CPU smoke's host-memory refusal quoted full fine-tuning's weights, gradients and
    AdamW state (4 x the weights) for a LoRA run, which holds the frozen weights and a small
    adapter state."""
    full = load_model_file(DEEP)
    lora = dataclasses.replace(full, adapters=Adapters(lora_rank=4))
    cfg = SmokeConfig(strategy="single", num_gpus=1, precision="fp32", checkpointing=False,
                      micro_batch=8, grad_accum=1)
    assert host_bytes_needed(lora, cfg) * 4 == host_bytes_needed(full, cfg)


def test_parallel_states_its_allocator_and_what_expandable_segments_would_fit():
    """`recommend` launches with expandable segments; `parallel` assumes PyTorch's defaults.
    It says so, and names a strategy that only the setting would make fit: GPT-2 small under
    zero3 at micro-batch 8 needs 12.21 GB reserved by default and 11.02 GB with it, and the
    budget here sits between the two."""
    gpt2 = os.path.join(HERE, "..", "sample_models", "gpt2_small.py")
    args = ["parallel", gpt2, "--gpus", "2", "-b", "8", "--strategy", "zero3", "--memory",
            "11.37GiB", "--overhead", "0"]
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 1, text.output
    assert "allocator: PYTORCH_CUDA_ALLOC_CONF unset (PyTorch's defaults)" in text.output
    assert "zero3: would fit with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text.output
    payload = json.loads(CliRunner().invoke(cli, [*args, "--json"]).stdout)
    [fix] = payload["fits_with_expandable_segments"]
    assert fix["strategy"] == "zero3" and fix["peak_device_bytes"] < payload["budget_bytes"]
    # with the setting given, it fits as assumed and nothing more is said
    roomy = CliRunner().invoke(cli, [*args, "--alloc-conf", "expandable_segments:True"])
    assert roomy.exit_code == 0 and "would fit" not in roomy.output


def test_a_lora_device_map_names_the_base_model(tmp_path):
    """`split --device-map` wrote peft's names (base_model.model.0), which
    from_pretrained(device_map=...) cannot place; it writes the base model's, and smoke maps
    them back onto the LoRA-wrapped model it dispatches."""
    path = str(tmp_path / "map.json")
    r = CliRunner().invoke(cli, ["split", DEEP, "--lora", "4", "-b", "4", "--gpus", "2",
                                 "--gpu", "rtx3090", "--device-map", path])
    assert r.exit_code == 0, r.output
    with open(path) as f:
        keys = json.load(f)["device_map"]
    assert keys and not any(k.startswith("base_model") for k in keys)
    assert set(keys) >= {str(i) for i in range(7)}
    s = CliRunner().invoke(cli, ["smoke", DEEP, "--lora", "4", "--strategy", "pipeline2",
                                 "--device-map", path, "-b", "4", "--steps", "2"])
    assert s.exit_code == 0, s.output


def test_link_is_an_option_wherever_gpus_are_planned():
    """A user with NVLink-bridged 3090s could say so only to recommend: probe's multi-GPU plan
    assumed no P2P for a GeForce card, and parallel never said what it assumed."""
    tiny = os.path.join(HERE, "..", "sample_models", "tiny_mlp.py")
    probe = CliRunner().invoke(cli, ["probe", tiny, "--gpu", "rtx3090", "--num-gpus", "2",
                                     "--link", "nvlink", "--json", "-j", "1"])
    assert probe.exit_code == 0, probe.output
    assert json.loads(probe.stdout)["multi_gpu_plan"]["link"] == "nvlink"
    base = ["parallel", DEEP, "--gpus", "2", "-b", "8", "--gpu", "rtx3090"]
    geforce = CliRunner().invoke(cli, base)
    assert "GPUs linked by pcie-no-p2p" in geforce.output
    assert "dp: these GPUs have no peer-to-peer access" in geforce.output
    bridged = CliRunner().invoke(cli, [*base, "--link", "nvlink", "--json"])
    assert json.loads(bridged.stdout)["link"] == "nvlink"


def test_one_configuration_one_answer_in_every_command(tmp_path):
    """zero3 on two GPUs in bf16 (FSDP's policy), a 26M-parameter Llama, as recommend plans it
    (micro-batch 16 x 2 accumulation for an effective 64) and as parallel, estimate and probe see
    the same configuration with the same allocator setting. recommend checks its plan with the
    accumulation its launch line sets (before, it quoted one micro-batch's peak: 428 MB where
    the run holds 484 MB); parallel and estimate agree to the byte; recommend is within one
    2 MiB page of them (its traces come after others in the same process; the cause of that
    page is not found); probe's largest batch is the largest one recommend could choose."""
    card = [config_folder(tmp_path, LLAMA_26M), "--seq-len", "64", "--memory", "600MiB", "--overhead", "0",
            "--precision", "bf16"]
    rec = json.loads(CliRunner().invoke(cli, [
        "recommend", *card, "--num-gpus", "2", "--strategy", "zero3", "--target-batch", "64",
        "--json", "-j", "1"]).stdout)["best"]
    assert (rec["strategy"], rec["checkpointing"], rec["micro_batch"], rec["grad_accum"]) == \
        ("zero3", False, 16, 2)
    same = [*card, "--alloc-conf", "expandable_segments:True", "-b", "16", "--grad-accum", "2",
            "--json"]
    par = json.loads(CliRunner().invoke(cli, ["parallel", *same, "--gpus", "2", "--strategy",
                                              "zero3"]).stdout)
    est = json.loads(CliRunner().invoke(cli, ["estimate", *same, "--strategy", "fsdp",
                                              "--num-gpus", "2"]).stdout)
    peak = par["strategies"][0]["gpus"][0]["device_peak_bytes"]
    assert est["strategies"][0]["gpus"][0]["device_peak_bytes"] == peak
    assert abs(rec["peak_device_bytes"] - peak) <= 2 * 2**20
    probe = json.loads(CliRunner().invoke(cli, [
        "probe", *card, "--alloc-conf", "expandable_segments:True", "--strategy", "fsdp",
        "--num-gpus", "2", "--no-checkpointing", "--grad-accum", "2", "--json", "-j", "1"]).stdout)
    [row] = probe["results"]
    largest = row["max_batch_size"]
    assert 16 <= largest < 32          # recommend's choices are the divisors of 64 / 2


def test_bucket_view_is_an_option_wherever_ddp_is_planned():
    """--bucket-view on `estimate --strategy ddp` gives parallel's DDP figure with the same flag;
    without --strategy ddp it is a usage error, not a silent no-op."""
    tiny = os.path.join(HERE, "..", "sample_models", "tiny_mlp.py")
    common = ["-b", "8", "--gpu", "a10", "--json", "--bucket-view"]

    def peak(args):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 0, r.output
        [strategy] = json.loads(r.stdout)["strategies"]
        return [g["peak_allocated_bytes"] for g in strategy["gpus"]]

    est = peak(["estimate", tiny, "--strategy", "ddp", "--num-gpus", "2", *common])
    par = peak(["parallel", tiny, "--strategy", "ddp", "--gpus", "2", *common])
    plain = peak(["estimate", tiny, "--strategy", "ddp", "--num-gpus", "2", *common[:-1]])
    assert est == par and est[0] < plain[0]     # the gradients' second copy is gone
    r = CliRunner().invoke(cli, ["estimate", tiny, "-b", "8", "--bucket-view"])
    assert r.exit_code == 2 and "--strategy ddp" in r.output
