"""The models of the parity and wrapping tests.

Every FSDP name they use comes from ``fsdptest.api``, so they run under
either implementation; "the device" is the rank's (``fsdptest.api.current_device``).
Test models (``fsdptest.interface.FSDPTestModel``) are built with
``Model.init(group, fsdp_init_mode, device_init_mode, fsdp_kwargs, deterministic=...)``.
"""

from models.batchnorm import BatchNormNet
from models.delays import sleep_ms
from models.dummies import DummyDDP, DummyProcessGroup
from models.experts import MixtureOfExperts
from models.inputs import SaveForwardInputsModel, SaveForwardInputsModule
from models.lora import LoraAttention, LoraDecoder, LoraMLP, LoraModel
from models.nested import (
    AlwaysWrapNestedWrappedModule,
    LayerFactory,
    ModuleWithDelay,
    NestedWrappedModule,
    NestedWrappedModuleWithDelay,
    NonUniformReqGradNWM,
)
from models.resnet import resnet50
from models.sequential import NestedSequentialModel
from models.small import (
    MLP,
    DeterministicModel,
    DoubleLinear,
    MLPStack,
    NestedLinear,
    SkipModel,
    SkipModule,
)
from models.tensor_parallel import MLPModule, MLPStacked, RMSNormPython
from models.transformer import TransformerWithSharedParams

__all__ = [
    "AlwaysWrapNestedWrappedModule",
    "BatchNormNet",
    "DeterministicModel",
    "DoubleLinear",
    "DummyDDP",
    "DummyProcessGroup",
    "LayerFactory",
    "LoraAttention",
    "LoraDecoder",
    "LoraMLP",
    "LoraModel",
    "MLP",
    "MLPModule",
    "MLPStack",
    "MLPStacked",
    "MixtureOfExperts",
    "ModuleWithDelay",
    "NestedLinear",
    "NestedSequentialModel",
    "NestedWrappedModule",
    "NestedWrappedModuleWithDelay",
    "NonUniformReqGradNWM",
    "RMSNormPython",
    "SaveForwardInputsModel",
    "SaveForwardInputsModule",
    "SkipModel",
    "SkipModule",
    "TransformerWithSharedParams",
    "resnet50",
    "sleep_ms",
]
