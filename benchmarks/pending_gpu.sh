#!/bin/bash
# The measurements benchmarks/results/README.md lists as waiting for a GPU, in one run of a few
# minutes on one CUDA card (an H200 took about 4 minutes for these in earlier runs):
#
#     OUT=/tmp/pending bash benchmarks/pending_gpu.sh
#
# Writes $OUT/heldout.jsonl and $OUT/resnet.jsonl (one trace_sample.py record per line: peaks,
# the CUDA context, GPU, driver and torch) and the allocator's events as tarballs. Each run is
# a fresh process, so no run's freed ranges are another's.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset PYTORCH_CUDA_ALLOC_CONF
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)" || {
    echo "pending_gpu.sh: no CUDA GPU visible; run it on a machine with an NVIDIA GPU" >&2
    exit 2
}
T=$(mktemp -d)

# 1. The convolution rule held out: torchvision's VGG-16 and DenseNet-121 in bf16 AMP at 64, at
#    the probe's largest batch (3132 and 2221 with today's rule) and one more, the model built
#    on the host and moved, as a training script does.
held() { timeout 60 python3 benchmarks/trace_sample.py "$@" --moved --out "$T/heldout" \
             >>"$OUT/heldout.jsonl" 2>>"$OUT/run.log"; }
mkdir -p "$T/heldout"
for args in "vgg16 bf16 64" "vgg16 bf16 3132" "vgg16 bf16 3133" \
            "densenet121 bf16 64" "densenet121 bf16 2221" "densenet121 bf16 2222"; do
    set -- $args
    held "torchvision:$1" "$2" "$3"
done
tar czf "$OUT/heldout-traces.tgz" -C "$T" heldout 2>>"$OUT/run.log"

# 2. ResNet in 16 bits at 4096 in fresh processes, built on the GPU as calibrate.py's harness
#    did: the four KNOWN_DEVIATIONS rows "ResNet's 16-bit workspaces after earlier runs, or
#    cuDNN's fp16 plans" (tests/test_calibration.py). Inside the tolerance fresh, as bf16
#    without checkpointing is (-1.1%): the long-lived process's history. Outside: cuDNN's plans.
fresh() { timeout 90 python3 benchmarks/trace_sample.py "$@" --out "$T/resnet" \
              >>"$OUT/resnet.jsonl" 2>>"$OUT/run.log"; }
mkdir -p "$T/resnet"
fresh resnet_cnn fp16 4096
fresh resnet_cnn fp16 4096 --checkpointing
fresh resnet_cnn bf16 4096 --checkpointing
fresh resnet_cnn bf16-pure 4096
tar czf "$OUT/resnet-traces.tgz" -C "$T" resnet 2>>"$OUT/run.log"
echo "written to $OUT: $(ls "$OUT" | tr '\n' ' ')"
