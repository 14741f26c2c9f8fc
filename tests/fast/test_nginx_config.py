"""The nginx recipe (config/nginx.conf) as `python -m infinity replicas` writes it for its
replicas, and how the launcher splits the cores."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from infinity.replicas import NGINX_CONFIG, render_nginx_config, split_cores


def test_the_upstream_and_listen_port_are_the_launchers(tmp_path):
    rendered = render_nginx_config(NGINX_CONFIG.read_text(), 9090, [9101, 9102, 9103], tmp_path)
    upstream = re.search(r"upstream infinity \{(.*?)\n    \}", rendered, re.S).group(1)
    assert re.findall(r"server (\S+) max_fails=1 fail_timeout=2s;", upstream) == [
        "127.0.0.1:9101", "127.0.0.1:9102", "127.0.0.1:9103"]
    assert "least_conn;" in upstream and "keepalive 64;" in upstream
    assert re.findall(r"listen (\S+);", rendered) == ["127.0.0.1:9090"]
    assert f"client_body_temp_path {tmp_path / 'client_body'};" in rendered


def test_the_recipe_keeps_what_the_fault_tests_rely_on():
    text = NGINX_CONFIG.read_text()
    assert "proxy_next_upstream error timeout http_502 http_503 non_idempotent;" in text
    assert "http_429" not in text.split("proxy_next_upstream ", 1)[1].split(";")[0]
    assert "proxy_http_version 1.1;" in text and 'proxy_set_header Connection "";' in text
    assert "client_max_body_size 16m;" in text  # the server's max_request_bytes default


def test_a_config_without_the_upstream_is_refused(tmp_path):
    with pytest.raises(ValueError, match="upstream infinity"):
        render_nginx_config("http {\n}\n", 1, [2], tmp_path)


@pytest.mark.skipif(shutil.which("nginx") is None, reason="needs nginx on PATH")
def test_nginx_accepts_the_rendered_config(tmp_path):
    conf = tmp_path / "nginx.conf"
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (tmp_path / kind).mkdir()
    conf.write_text(render_nginx_config(NGINX_CONFIG.read_text(), 9090, [9101, 9102], tmp_path))
    result = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-c", str(conf), "-g",
                             f"pid {tmp_path / 'nginx.pid'}; error_log stderr;"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_cores_are_split_between_replicas_only_when_each_gets_one():
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([0, 1], 2) == [[0], [1]]
    assert split_cores([0, 1], 3) == [None, None, None]
