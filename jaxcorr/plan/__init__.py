"""Pod scale checked by the compiler: a run's update step and the engine's
decode step lowered and compiled for a model shape and mesh on fake CPU
devices, with abstract arrays (docs/tpu.md, "Planning a pod")."""
