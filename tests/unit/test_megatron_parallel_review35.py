"""Review 35, megatron-core library API without process groups: ``initialize_from_layout`` before
``torch.distributed`` is initialised is one ConfigError naming the fix (was torch's ValueError from
deep inside ``get_world_size``)."""
from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")


def test_initialize_from_layout_before_init_process_group_is_a_config_error():
    import torch.distributed as dist

    from elastor_ds.errors import ConfigError
    from elastor_ds.integrations.megatron import initialize_from_layout
    from elastor_ds.layout import Layout

    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match=r"torch.distributed is not initialised; call "
                                          r"torch.distributed.init_process_group\(...\) on 2 ranks first .*"
                                          r"tp\(2\) \* pp\(1\) \* dp\(1\)"):
        initialize_from_layout(Layout.uniform(2, 1, 1, 2))
