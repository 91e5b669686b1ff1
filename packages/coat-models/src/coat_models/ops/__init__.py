"""coat_models' own Triton kernels, one file per op (kernels, launchers, the custom op and
its ``autograd.Function``): ``rope``, and ``cross_entropy`` (``linear_cross_entropy``'s
per-chunk forward and backward passes). Internal: ``coat_models.blocks`` and
``coat_models.loss`` use them; the FP8
ops of a layer come from ``fp8_activations``. Nothing is imported here."""
