"""Training: dense models, the train state and step, the fit loop, checkpoints, metrics and
multi-process initialisation."""
