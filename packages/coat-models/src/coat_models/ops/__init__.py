"""coat_models' own Triton kernels, one file per op (kernels, launchers, the custom op and
its ``autograd.Function``): ``rope``. Internal: ``coat_models.blocks`` uses them; the FP8
ops of a layer come from ``fp8_activations``. Nothing is imported here."""
