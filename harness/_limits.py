"""Known limits of the implementations under test, shared by the plugin and the API module."""

TORCH_CPU_OFFLOAD_SKIP = (
    "torch.distributed.fsdp cannot offload parameters to the CPU without an accelerator "
    "(CPUOffload(offload_params=True) pins memory and synchronizes accelerator streams; "
    "torch 2.13 raises 'Cannot access accelerator device when none is available')"
)
