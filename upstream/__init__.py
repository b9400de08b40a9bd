"""Upstream's FSDP test utilities on this harness, so that a test file written
against ``torch.testing._internal`` runs here after changing only its imports.

- ``upstream.common_fsdp``: ``FSDPTest`` and its variants, the init modes
  (``FSDPInitMode``, ``DEVICEInitMode``, ``CUDAInitMode``), the test models and
  helpers (``get_full_params``, ``_zero_model``, ``subtest_name``, ...).
- ``upstream.common_distributed``: ``skip_if_lt_x_gpu``, ``TEST_SKIPS``,
  ``MultiProcessTestCase``, ``run_subtests``.
- ``upstream.common_dtensor``: ``DTensorTestBase``, ``DTensorContinuousTestBase``,
  ``with_comms``, ``skip_if_lt_x_gpu``, ``MLPModule``, ``RMSNormPython``.
- ``upstream.common_device_type``: ``instantiate_device_type_tests``, ``get_devtype``.
- ``upstream.common_utils``: ``parametrize``, ``subtest``,
  ``instantiate_parametrized_tests``, ``TestCase``, ``run_tests``, the ``TEST_*`` flags.
- ``upstream.fsdp_traversal``: ``_get_fsdp_states``/``_get_fsdp_handles`` for
  both FSDP implementations (torch's ``fsdp._traversal_utils``).

The code is this project's; only names and behaviour follow upstream. The
README's "Porting an upstream test" lists the imports and what differs.
"""
