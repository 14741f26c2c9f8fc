"""Unit tests of configuration loading: precedence, validation, messages that name keys."""

import pytest

from infinity.cli import build_parser
from infinity.config import ConfigError, load_config
from infinity.client.supervisor import cpu_quota, plan_cpus


def _toml(tmp_path, text: str):
    path = tmp_path / "models.toml"
    path.write_text(text)
    return path


def test_defaults_serve_the_packaged_model():
    config = load_config(env={})
    assert config.server.port == 7997
    assert [(m.name, m.source) for m in config.models] == [("all-MiniLM-L6-v2", "default")]


def test_cli_beats_env_beats_file(tmp_path):
    path = _toml(tmp_path, "[server]\nport = 8001\nhost = '127.0.0.1'\n")
    assert load_config(path, env={}).server.port == 8001
    assert load_config(path, env={"INFINITY_PORT": "8002"}).server.port == 8002
    config = load_config(path, env={"INFINITY_PORT": "8002"}, server_overrides={"port": 8003})
    assert config.server.port == 8003
    assert config.server.host == "127.0.0.1"


def test_model_flag_replaces_the_file_models(tmp_path):
    path = _toml(tmp_path, "[[models]]\nname = 'a'\nsource = '/models/a'\n")
    assert [m.name for m in load_config(path, env={}).models] == ["a"]
    config = load_config(path, env={}, model_source="/models/b/")
    assert [(m.name, m.source) for m in config.models] == [("b", "/models/b/")]
    config = load_config(path, env={"INFINITY_MODEL": "org/c"}, model_name="c-served")
    assert [(m.name, m.source) for m in config.models] == [("c-served", "org/c")]


@pytest.mark.parametrize("text, key", [
    ("[server]\nprot = 1\n", "prot"),
    ("[server]\nport = 'abc'\n", "port"),
    ("[server]\nport = 70000\n", "server.port"),
    ("[[models]]\npooling = 'median'\n", "pooling"),
    ("[[models]]\nname = 'x'\nbatch = 3\n", "batch"),
    ("[[models]]\nmax_batch_size = 0\n", "max_batch_size"),
    ("[[models]]\nmax_input_chars = 0\n", "max_input_chars"),
    ("[[models]]\nengine = 'openvino'\ndtype = 'int8'\n", "models.dtype: the openvino engine takes dtype"),
    ("[server]\nurl_prefix = 'v2/'\n", "url_prefix"),
    ("[[models]]\nname = 'a'\n[[models]]\nname = 'a'\n", "unique"),
    ("[media]\nfetch_timeout = 0\n", "media.fetch_timeout"),
    ("[media]\nmax_redirects = -1\n", "media.max_redirects"),
    ("[media]\nfetch_url = false\n", "fetch_url"),
    ("[server]\nmax_queued_items = 8\nmax_queued_items_low_priority = 9\n", "server.max_queued_items_low_priority"),
    ("[[api_keys]]\nkey = 'k'\npriority = 101\n", "priority"),
    ("[[api_keys]]\nkey = ''\n", "api_keys.key"),
])
def test_bad_config_names_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as error:
        load_config(_toml(tmp_path, text), env={})
    assert key in str(error.value)


def test_api_keys_and_the_low_priority_share(tmp_path):
    text = "[server]\napi_key = 'q'\nmax_queued_items = 100\n[[api_keys]]\nkey = 'ingest'\npriority = 1\n"
    config = load_config(_toml(tmp_path, text), env={})
    assert config.key_priorities() == {"q": 0, "ingest": 1}
    assert config.server.low_priority_items == 50  # half of max_queued_items by default
    assert load_config(env={"INFINITY_MAX_QUEUED_ITEMS_LOW_PRIORITY": "7"}).server.low_priority_items == 7
    assert load_config(env={}).key_priorities() == {}


def test_bad_env_value_names_the_key():
    with pytest.raises(ConfigError, match="port"):
        load_config(env={"INFINITY_PORT": "not-a-number"})


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_toml(tmp_path, "[server\n"), env={})


def test_help_documents_every_server_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--config", "--model", "--port", "--api-key", "--url-prefix", "--tokenizer-workers",
                 "--max-queued-items", "INFINITY_"):
        assert flag in text


@pytest.mark.parametrize("cpus, workers, tokenizers, inference, threads", [
    ([0, 1], 0, [None], None, 2),
    ([0, 1, 2, 3], 0, [[3]], [0, 1, 2], 3),
    (list(range(16)), 0, [[14], [15]], list(range(14)), 14),
    (list(range(8)), 3, [[5], [6], [7]], list(range(5)), 5),
    ([0, 1], 2, [None, None], None, 2),
])
def test_cpu_plan(cpus, workers, tokenizers, inference, threads):
    plan = plan_cpus(cpus, workers)
    assert plan.tokenizer_cpus == tokenizers
    assert plan.inference_cpus == inference
    assert plan.inference_threads == threads


def test_the_media_table(tmp_path):
    config = load_config(_toml(tmp_path, "[media]\nallow_private_networks = true\nallowed_domains = ['example.com']\n"),
                         env={})
    assert config.media.allow_private_networks and config.media.allowed_domains == ["example.com"]
    assert load_config(None, env={}).media.fetch_urls


def test_a_cpu_quota_sizes_the_plan_and_pins_nothing():
    """A container limited to 2.5 cores' time on a 16-core machine: planned as 2 cores
    (one tokenizer sharing them with inference's 2 threads), nothing pinned; 8 cores' time
    plans 8 (a pinned tokenizer's worth of cores, unpinned)."""
    cores = list(range(16))
    plan = plan_cpus(cores, quota=2.5)
    assert (plan.tokenizer_cpus, plan.inference_cpus, plan.inference_threads) == ([None], None, 2)
    assert plan.cpu_partitions == [(None, 2)]
    plan = plan_cpus(cores, quota=8.0)
    assert (plan.tokenizer_cpus, plan.inference_cpus, plan.inference_threads) == ([None], None, 7)
    # As on a 4-core machine: a core's worth for the tokenizer, the partitions split the rest.
    assert plan_cpus(cores, cpu_partitions=2, quota=4.0).cpu_partitions == [(None, 2), (None, 1)]
    # A quota of at least every usable core changes nothing.
    assert plan_cpus(cores, quota=16.0) == plan_cpus(cores) == plan_cpus(cores, quota=None)
    assert plan_cpus(cores, quota=0.5).inference_threads == 1


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "250000 100000\n"}, 2.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1.5),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_the_cpu_quota_is_read_from_cgroup_v2_or_v1(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(tmp_path) == quota
