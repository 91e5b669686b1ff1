"""coat-train: the training product built on coat_models (the trainer, its CLI, data, presets,
checkpoints of a run, reports). The integration (``apply_coat``, ``create_optimizer``, the
multi-GPU helpers) does not import it.

Modules: ``cli`` (``coat-train``), ``trainer`` (``Trainer``, ``TrainConfig``), ``tasks``
(what differs between model kinds), ``data`` / ``vl_data`` (token files, the stdlib corpus,
the shapes-caption task), ``presets``, ``memory`` (the memory breakdown), ``report`` (metrics,
table, plot). Nothing is imported here, so that ``import coat_models`` stays light.
"""
