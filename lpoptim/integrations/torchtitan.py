"""lpoptim in torchtitan: its low-bit linears and FP8 activations as a model converter, lpoptim.AdamW as an optimizer.

torchtitan changed its configuration between 0.2 (``JobConfig``: TOML and ``--section.key`` flags, registries of
converters and train specs) and 0.3 (``Configurable`` configs built by Python functions, which needs torch with
``torch.distributed.fsdp.DataParallelMeshDims``, i.e. newer than 2.11). This module serves the installed one.

torchtitan >= 0.3 (lpoptim/integrations/_torchtitan_configurable.py):

    config.model_spec = model_registry("8B", converters=[LpoptimConverter.Config()])  # as Float8LinearConverter
    config.optimizer = lpoptim_adamw(lr=3e-4, state_bits=8)                            # as default_adamw
    config.activation_checkpoint = None       # FP8 activations take activation checkpointing's place
    config = use_lpoptim(llama3_8b())         # or all three on any Trainer.Config

    torchrun --nproc_per_node 2 -m torchtitan.train --module lpoptim.integrations.torchtitan --config llama3_8b_lpoptim

torchtitan 0.2 (lpoptim/integrations/_torchtitan_jobconfig.py): importing this module registers the converter
"lpoptim" and the train spec "llama3_lpoptim" (llama3 with ``--optimizer.name lpoptim.AdamW`` available):

    torchrun --nproc_per_node 2 -m torchtitan.train --job.config_file <llama3 toml> \\
        --experimental.custom_import lpoptim.integrations.torchtitan \\
        --job.custom_config_module lpoptim.integrations.torchtitan \\
        --model.name llama3_lpoptim --model.converters lpoptim --optimizer.name lpoptim.AdamW \\
        --activation_checkpoint.mode none        # [lpoptim] recipe/filter_fqns/activations/recompute,
                                                 # optimizer.state_bits / bf16_stochastic_round

torchtitan is imported here, never by ``import lpoptim``: only this module needs it.
"""
try:
    import torchtitan  # noqa: F401
except ImportError as e:  # pragma: no cover - the tests skip without torchtitan
    raise ImportError("lpoptim.integrations.torchtitan needs torchtitan (pip install torchtitan); "
                      "lpoptim itself does not") from e

try:
    from torchtitan.config.configurable import Configurable  # noqa: F401  (torchtitan >= 0.3)
except ImportError:
    from ._torchtitan_jobconfig import *  # noqa: F401,F403
    from ._torchtitan_jobconfig import __all__, OPTIMIZER_NAME  # noqa: F401
    API = "jobconfig"
else:
    from ._torchtitan_configurable import *  # noqa: F401,F403
    from ._torchtitan_configurable import __all__, OPTIMIZER_NAME  # noqa: F401
    API = "configurable"
