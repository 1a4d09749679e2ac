"""How a forward is computed on this machine: packed and split linear layers
(:mod:`.cpu`), int8 draft copies (:mod:`.quant`), int8 / int4 weight-only verifiers
(:mod:`.lowbit`), ordered attention (:mod:`.ordered`) and the
probes that decide whether low-precision verification is batch-invariant
(:mod:`.invariance`)."""
