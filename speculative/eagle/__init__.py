"""EAGLE drafting (Li et al. 2024, 2025): one draft layer over the target's own hidden states.

One concern a file:

- :mod:`.layer` -- the draft layer as an ``nn.Module`` (EAGLE-3: fused low / mid / high
  features and a draft vocabulary; EAGLE-1: the final hidden state);
- :mod:`.formats` -- files: the EAGLE-3 format vLLM and SGLang read (saved too), EAGLE-1;
- :mod:`.drafter` -- the ``eagle`` drafter strategy (:class:`Eagle`): its own cache per row,
  dynamic trees (EAGLE-2), every row of a batch together;
- :mod:`.train` -- ``accel train-eagle``: self-distilled training with training-time test.
"""

from .drafter import Eagle, load_eagle
from .formats import read_eagle, save_eagle
from .layer import EagleLayer, EagleSpec, default_layer_ids, new_layer, warm_start

__all__ = ["Eagle", "EagleLayer", "EagleSpec", "default_layer_ids", "load_eagle", "new_layer", "read_eagle", "save_eagle", "warm_start"]
