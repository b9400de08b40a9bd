"""Names the FSDP test layer's plugin and its API facade share (the plugin must
not import the facade: the facade picks the implementation when imported)."""

IMPL_ENV = "FSDP_HARNESS_IMPL"  # the implementation under test, set by the plugin

TORCH_CPU_OFFLOAD_SKIP = (
    "torch.distributed.fsdp cannot offload parameters to the CPU without an accelerator "
    "(CPUOffload(offload_params=True) pins memory and synchronizes accelerator streams; "
    "torch 2.13 raises 'Cannot access accelerator device when none is available')"
)

# What torch's FSDP raises when asked to offload parameters without an accelerator
# (a regular expression): a CPU build of torch says the first, a CUDA build whose
# ranks see no GPU (CPU ranks on a GPU machine) the second.
TORCH_CPU_OFFLOAD_ERROR = (
    "Cannot access accelerator device when none is available|No CUDA GPUs are available"
)

CPU_OFFLOAD_ASSERTED_MARKER = "torch_cpu_offload_asserted"
CPU_OFFLOAD_ASSERTED_HELP = (
    f"{CPU_OFFLOAD_ASSERTED_MARKER}: under --fsdp-impl torch on CPU, the test asserts torch's "
    "failure to offload parameters itself (fsdptest.api.assert_torch_refuses_cpu_offload) "
    "instead of being skipped"
)
