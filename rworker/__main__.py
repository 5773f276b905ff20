"""python -m rworker --listen HOST:PORT --kv-capacity SIZE --threads N [...]

Serves the R-Part (KV-cache + attention) over gRPC. Prints "READY <host:port>"
on stderr once serving; SIGTERM drains (new sequences refused, open ones
served until closed) and exits 0.
"""
from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys

from rpart.formats import INT4_GROUPS, parse_size
from rpart.auth import read_token
from rworker.server import ServerOptions, serve
from rpart.wire import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rworker", description=__doc__.split("\n\n")[1])
    p.add_argument("--listen", default="127.0.0.1:50061", help="HOST:PORT (port 0 = any free port)")
    p.add_argument("--kv-capacity", default="1G", type=parse_size, help="KV pool size, e.g. 512M, 4G")
    p.add_argument("--threads", default=0, type=int, help="kernel threads (0 = all cores)")
    p.add_argument("--block-size", default=16, type=int, help="tokens per KV block")
    p.add_argument("--no-int4-fp16-tail", dest="int4_fp16_tail", action="store_false",
                   help="int4 KV: no fp16 copy of each sequence's newest block (its 1/8 of the capacity "
                        "goes to int4 blocks; perplexity cost rises from +3.8%% to +8.7%% on the default model)")
    for which, default in (("k", 32), ("v", 64)):
        p.add_argument(f"--int4-{which}-group", default=0, type=int, choices=INT4_GROUPS,
                       help=f"int4 KV: {'key' if which == 'k' else 'value'} channels per scale and zero point "
                            f"(0 = the kernel's default, {default}; larger groups read fewer bytes and round "
                            "more coarsely, see bench/results/int4_grouping.json)")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--token", default="", help="shared token every call must carry")
    tok.add_argument("--token-file", default="", help="file holding the shared token")
    p.add_argument("--tls-cert", default="", help="server certificate (PEM): enables TLS")
    p.add_argument("--tls-key", default="", help="server private key (PEM)")
    p.add_argument("--tls-client-ca", default="", help="CA of client certificates: enables mutual TLS")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --listen with neither a token nor mutual TLS (refused otherwise)")
    p.add_argument("--health-listen", default="",
                   help="HOST:PORT serving only grpc.health.v1, in plaintext (for probes that cannot use TLS)")
    p.add_argument("--max-message-size", default="64M", type=parse_size, help="largest message accepted")
    p.add_argument("--max-connections", default=64, type=int, help="concurrent S-worker streams")
    p.add_argument("--max-sequences", default=1 << 18, type=int, help="open sequences, all clients together")
    p.add_argument("--max-sequences-per-connection", default=1 << 16, type=int,
                   help="open sequences of one S-worker connection")
    p.add_argument("--max-table-memory", default="512M", type=parse_size,
                   help="memory for per-sequence tables outside --kv-capacity, all clients together "
                        "(~256 bytes + 32 per layer per open sequence)")
    p.add_argument("--keepalive-time", default=KEEPALIVE_TIME_MS / 1000, type=float,
                   help="seconds between HTTP/2 pings to each client; one unanswered for --keepalive-timeout "
                        "closes its connection and frees its KV")
    p.add_argument("--keepalive-timeout", default=KEEPALIVE_TIMEOUT_MS / 1000, type=float,
                   help="seconds a ping waits for its answer")
    p.add_argument("--drain-timeout", default=60.0, type=float, help="seconds SIGTERM waits for open sequences")
    p.add_argument("--store", default="kernel", choices=("kernel", "numpy"),
                   help="KV store: the C++ kernel, or the slow numpy reference")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    faulthandler.register(signal.SIGUSR1)     # kill -USR1 <pid>: dump every thread's stack to the log
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s rworker %(levelname)s %(message)s")
    if args.kv_capacity <= 0 or args.threads < 0 or args.block_size < 1 or args.max_sequences < 1 \
            or args.max_connections < 1 or args.max_message_size < 1024 or args.max_sequences_per_connection < 1 \
            or args.max_table_memory < 1 or args.keepalive_time <= 0 or args.keepalive_timeout <= 0:
        sys.exit("rworker: need --kv-capacity > 0, --threads >= 0, --block-size >= 1, --max-sequences >= 1, "
                 "--max-sequences-per-connection >= 1, --max-table-memory > 0, --max-connections >= 1, "
                 "--max-message-size >= 1K, --keepalive-time > 0, --keepalive-timeout > 0")
    if args.store == "numpy":
        from rworker.refstore import NumpyKVStore as store_factory
    else:
        from rworker.service import default_store_factory as store_factory
    try:
        return serve(_options(args), store_factory)
    except (ValueError, OSError) as e:        # bad settings or an unusable address: say so, no traceback
        sys.exit(f"rworker: {e}")


def _options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(
        listen=args.listen, kv_capacity=args.kv_capacity, threads=args.threads, block_size=args.block_size,
        int4_fp16_tail=args.int4_fp16_tail, int4_k_group=args.int4_k_group, int4_v_group=args.int4_v_group,
        token=read_token(args.token, args.token_file), tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca, max_message_bytes=args.max_message_size,
        max_connections=args.max_connections, max_sequences=args.max_sequences,
        max_sequences_per_connection=args.max_sequences_per_connection, max_table_bytes=args.max_table_memory,
        drain_timeout_s=args.drain_timeout, keepalive_time_s=args.keepalive_time,
        keepalive_timeout_s=args.keepalive_timeout, insecure=args.insecure, health_listen=args.health_listen)


if __name__ == "__main__":
    sys.exit(main())
