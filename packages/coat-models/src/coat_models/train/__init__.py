"""coat-train: the training product built on coat_models. Modules: ``cli`` (``coat-train``),
``jobs`` (what a run trains: model, data, tasks), ``trainer`` (``Trainer``, ``TrainConfig``),
``tasks`` (what differs between model kinds),
``data`` / ``vl_data``, ``presets``, ``memory`` (the memory breakdown), ``report``, ``outdir``
(the output directory: its lock, its checks, resume points), ``args`` (the parser of
coat-train and the benchmarks). The integration does not import it, and
nothing is imported here: ``import coat_models`` stays light.
"""
