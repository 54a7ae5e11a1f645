"""What a training state is: capture and restore of modules, optimizers and RNG (:mod:`.capture`), plain values
and their one value across ranks (:mod:`.values`), the resumable sampler (:mod:`.sampler`)."""
