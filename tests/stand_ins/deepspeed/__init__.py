"""A stand-in for the `deepspeed` package where it is not installed (the test environment does
not build it): only what a training script touches before oomdoctor's run replaces it -
`import deepspeed`, `deepspeed.init_distributed`, `deepspeed.initialize` (oomdoctor.sim.
deepspeed_engine patches both in a script's run; called here, outside one, they refuse). Tests
put its folder on sys.path only when the real package is missing."""


def init_distributed(*_args, **_kwargs):
    raise RuntimeError("the deepspeed stand-in runs only inside oomdoctor's script run")


def initialize(*_args, **_kwargs):
    raise RuntimeError("the deepspeed stand-in runs only inside oomdoctor's script run")
