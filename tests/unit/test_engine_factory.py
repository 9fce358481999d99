"""The one factory that makes a generator's engine, and the capabilities each engine declares:
``build_engine`` makes the engine the config names from its own section, refuses a setting it
cannot start without by name, and each engine's ``caps`` say how its weights arrive and whether
its aborts are batched; a member an engine's caps do not promise refuses, naming the engine."""

import pytest
import torch

from april_async.engines.base import Engine, EngineCaps
from april_async.engines.factory import build_engine
from april_async.engines.scripted import ScriptedEngine
from april_async.engines.sglang_engine import SGLangEngine
from april_async.engines.torch_engine import TorchEngine
from april_async.generator.config import GeneratorConfig
from april_async.testing.models import checkpoint
from april_async.testing.procs import free_port


def test_scripted_is_built_from_its_section_and_holds_no_weights():
    engine = build_engine(GeneratorConfig(engine="scripted", scripted={"slots": 3, "lengths": [5]}))
    try:
        assert isinstance(engine, ScriptedEngine) and engine.slots == 3 and engine.cfg.lengths == (5,)
        assert engine.caps == EngineCaps(weights="none", batched_abort=False) and engine.device is None
        with pytest.raises(NotImplementedError, match="the scripted engine has no load_weights"):
            engine.load_weights({}, 1)
        with pytest.raises(NotImplementedError, match="the scripted engine has no abort_all"):
            engine.abort_all()
    finally:
        engine.close()  # the base's: nothing to release


def test_torch_is_built_from_its_checkpoint_and_loads_weights_in_process(tmp_path):
    checkpoint(tmp_path / "ckpt", seed=0)
    engine = build_engine(GeneratorConfig(engine="torch", torch={"checkpoint": str(tmp_path / "ckpt"), "slots": 2,
                                                                 "max_seq_len": 64, "device": "cpu"}))
    assert isinstance(engine, TorchEngine) and engine.slots == 2 and engine.max_seq_len == 64
    assert engine.caps == EngineCaps(weights="in_process") and engine.device == torch.device("cpu")
    with pytest.raises(NotImplementedError, match="the torch engine has no server_urls"):
        engine.server_urls()
    engine.close()


def test_torch_without_a_checkpoint_is_refused_by_name():
    with pytest.raises(ValueError, match="torch.checkpoint is not set"):
        build_engine(GeneratorConfig(engine="torch"))


def test_sglang_is_built_for_its_servers_which_the_broadcaster_pushes_to():
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens: the first probe fails, and is logged
    engine = build_engine(GeneratorConfig(name="gen-f", engine="sglang",
                                          sglang={"servers": [url + "/"], "connect_timeout_s": 0.5,
                                                  "call_timeout_s": 0.5}))
    try:
        assert isinstance(engine, SGLangEngine) and engine.prefix.startswith("april-gen-f-")
        assert engine.caps == EngineCaps(weights="pushed", batched_abort=True) and engine.device is None
        assert engine.server_urls() == [url]
    finally:
        engine.close()


def test_sglang_without_servers_is_refused_by_name():
    with pytest.raises(ValueError, match="sglang.servers is empty"):
        build_engine(GeneratorConfig(engine="sglang"))


def test_the_base_declares_no_weights_and_refuses_what_it_does_not_have():
    class Bare(Engine):
        name = "bare"

    bare = Bare()
    assert bare.caps.weights == "none" and not bare.caps.batched_abort and bare.device is None
    bare.close()
    for call in (lambda: bare.load_weights({}, 1), bare.server_urls, bare.refresh_versions, bare.abort_all):
        with pytest.raises(NotImplementedError, match=r"the bare engine has no \w+ \(its caps: EngineCaps"):
            call()
