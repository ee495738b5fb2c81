"""The install leaves out PyPI's CUDA torchvision (docs/engines.md), so transformers' model classes import."""

import importlib.util


def test_transformers_mixtral_classes_import():
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.models.mixtral import modeling_mixtral

    assert MixtralForCausalLM.config_class is MixtralConfig
    assert hasattr(modeling_mixtral, "MixtralSparseMoeBlock")


def test_torchvision_is_not_installed_beside_cpu_torch():
    import torch

    if "+cpu" in torch.__version__:
        assert importlib.util.find_spec("torchvision") is None


def test_engines_import_together():
    import dagster
    import megatron.core
    import mlflow
    import vllm

    assert dagster.__version__.startswith("1.13")
    assert mlflow.__version__.startswith("3.")
    assert megatron.core.__version__ and vllm.__version__
