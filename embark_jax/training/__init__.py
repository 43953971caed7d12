"""Training: the state and its setup, the pure train step (in place, transactional), the
step runner, the fit loop and its callbacks, checkpoints, metrics, learning-rate schedules,
dense models and multi-process start-up."""

from embark_jax.core.exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "CheckpointEvery": "checkpoint",
        "DenseConfig": "models",
        "FitSummary": "loop",
        "NonFiniteLossError": "runner",
        "StepRunner": "runner",
        "Totals": "runner",
        "TrainSetup": "state",
        "TrainState": "state",
        "WarmupDecay": "schedules",
        "compile_train_step": "step",
        "create": "state",
        "fit": "loop",
        "restore": "checkpoint",
        "save": "checkpoint",
        "train_step": "step",
    },
)
