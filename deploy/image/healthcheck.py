"""The images' HEALTHCHECK: exit 0 when the server's GET /health answers 200 (every model
loaded and warm), 1 otherwise (503 while loading, restarting a child or draining; no answer).

Standard library only, so the images need no curl. The port and path prefix come from the
same INFINITY_PORT and INFINITY_URL_PREFIX variables the server reads (a port or prefix set
only in models.toml is not seen here: set it by variable, or override the HEALTHCHECK).
Proxy variables are ignored: the check always talks to 127.0.0.1.
"""

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("INFINITY_PORT", "7997")
    if not port.isdigit():  # e.g. a Kubernetes service link, tcp://10.0.0.1:7997
        port = "7997"
    prefix = "/" + os.environ.get("INFINITY_URL_PREFIX", "").strip("/")
    url = f"http://127.0.0.1:{port}{prefix.rstrip('/')}/health"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=float(os.environ.get("HEALTHCHECK_TIMEOUT", "5"))) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"healthcheck: {url}: HTTP {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
