"""Test-wide JAX setup: 8 fake CPU devices for sharding tests.

The device count must be set before any backend initialises, so it lives here
and nowhere else; tests that need another count run a subprocess.
"""

import jax

jax.config.update('jax_num_cpu_devices', 8)
jax.config.update('jax_platforms', 'cpu')
