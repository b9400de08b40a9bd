"""What torchrun tells each process it starts, read from the environment once."""

from __future__ import annotations

import os
from dataclasses import dataclass

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class NotUnderTorchrun(ValueError):
    """Names the variables of torchrun's environment that are missing."""


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    run_id: str
    restart: int

    @classmethod
    def read(cls) -> TorchrunEnv:
        missing = [name for name in _REQUIRED if name not in os.environ]
        if missing:
            raise NotUnderTorchrun(", ".join(missing))
        env = os.environ
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
            restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )

    def describe(self) -> str:
        return (
            f"rank {self.rank} of {self.world_size} (local rank {self.local_rank} "
            f"of {self.local_world_size})"
        )
