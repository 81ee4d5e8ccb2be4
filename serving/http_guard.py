"""serve's HTTP front: every HTTP request reaches Triton through this guard, which refuses with a 4xx what the
bundled tritonserver (2.51) cannot take without dying or answering 500.

Measured on that server (docs/serving-limits.md): a JSON body nested a few thousand levels deep (`[[[[...`, 200 kB)
overflows its parser's stack (SIGSEGV: every model down); a tensor whose shape claims more elements than it sends
(`"shape": [1, 1099511627776]`) makes it allocate the claimed size first (std::bad_alloc: SIGABRT); malformed JSON,
data of the wrong JSON type and a negative dimension are answered 500. Later Triton releases added
`--http-max-input-size` and a nesting limit; 2.51 has neither. So Triton's HTTP endpoint listens on a private
loopback port and this front, on the port the user asked for, reads each request whole (its size first), checks
its JSON (well-formed, no NaN, nesting, each input's name, datatype and shape against the served model's config,
its data's count and types) and forwards only what passes, byte for byte; Triton's answer comes back unchanged.
gRPC goes to Triton directly: protobuf bounds its own nesting, and Triton checks a raw tensor's byte size before it
allocates.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger(__name__)

# Triton's tensor datatypes: bytes an element (BYTES: variable), and the JSON values each takes.
ELEMENT_BYTES = {"BOOL": 1, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8, "INT8": 1, "INT16": 2, "INT32": 4,
                 "INT64": 8, "FP16": 2, "FP32": 4, "FP64": 8, "BF16": 2, "BYTES": None}
MAX_DEPTH = 8  # a request's JSON nests 5 levels deep at most ({"inputs": [{"data": [[...]]}]}) for a 2-D tensor
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection", "host",
        "content-length", "content-encoding"}


class RequestRefused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _no_constant(name: str):
    raise RequestRefused(400, f"the request's JSON holds {name}, which JSON does not allow; send finite numbers "
                              "(NaN and infinities cannot be a request's values)")


def parse_json(data: bytes, what: str = "the request's JSON"):
    """The JSON document of `data`: malformed JSON, NaN / Infinity and nesting past MAX_DEPTH refused (400)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestRefused(400, f"{what} is not UTF-8 text (byte {exc.start}); send UTF-8 JSON") from None
    try:
        document = json.loads(text, parse_constant=_no_constant)
    except RecursionError:  # Python's parser stops long before Triton's would overflow its stack
        raise RequestRefused(400, _deep(what)) from None
    except ValueError as exc:
        raise RequestRefused(400, f"{what} is not valid JSON ({exc}); send a JSON object "
                                  '{"inputs": [{"name", "shape", "datatype", "data"}]}') from None
    if _depth(document) > MAX_DEPTH:
        raise RequestRefused(400, _deep(what))
    return document


def _deep(what: str) -> str:
    return f"{what} nests deeper than {MAX_DEPTH} levels; a request's tensors are flat lists or lists of rows"


def _depth(value) -> int:
    """How deep containers nest in a parsed JSON value (a list of scalars: 1), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_DEPTH:
            return deepest
        stack += [(child, level + 1) for child in children if isinstance(child, (list, dict))]
    return deepest


def _leaves(data, name: str) -> list:
    """The scalar values of a (possibly nested) JSON data list, in order."""
    if not isinstance(data, list):
        return [data]
    if not {list, dict} & set(map(type, data)):  # a flat list (the common case, checked at C speed)
        return data
    out = []
    for value in data:
        if isinstance(value, dict):
            raise RequestRefused(400, f"input {name!r}: data holds an object; give values, or lists of them")
        out += _leaves(value, name)
    return out


def _check_values(values: list, dtype: str, name: str) -> None:
    """Each value of the JSON type and range of `dtype` (types compared as a set, ranges by min / max: a request of
    minutes of samples is checked in milliseconds)."""
    types = set(map(type, values))
    if dtype == "BYTES":
        ok, want = types <= {str}, "strings"
    elif dtype == "BOOL":
        ok, want = types <= {bool}, "true or false"
    elif dtype.startswith(("INT", "UINT")):
        bits = 8 * ELEMENT_BYTES[dtype]
        low, high = (0, 2 ** bits - 1) if dtype.startswith("U") else (-2 ** (bits - 1), 2 ** (bits - 1) - 1)
        ok = types <= {int} and (not values or low <= min(values) and max(values) <= high)
        want = f"whole numbers in [{low}, {high}]"
    else:
        largest = {"FP16": 65504.0, "BF16": 3.3895e38, "FP32": 3.4028235e38}.get(dtype, math.inf)
        ok = types <= {int, float} and (not values or max(map(abs, values)) <= largest)
        want = f"numbers {dtype} can hold"
    if not ok:
        raise RequestRefused(400, f"input {name!r} is {dtype}: its data must be {want}")


def _check_fields(item: dict, what: str) -> None:
    """The optional fields Triton reads as given types: "parameters" an object, "id" a string, "outputs" a list."""
    for key, kind, name in (("parameters", dict, "an object"), ("id", str, "a string"), ("outputs", list, "a list")):
        if key in item and not isinstance(item[key], kind):
            raise RequestRefused(400, f'"{key}" of {what} must be {name}, got {type(item[key]).__name__}')


def _count(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def check_inputs(request: dict, binary_bytes: int, limit: int, inputs: dict | None) -> None:
    """An infer request's header: each input's name (one of `inputs`, the model's {name: (datatype, dims)} when
    known), datatype, shape (non-negative, the model's rank) and data (JSON values of the datatype, as many as the
    shape holds, or a binary part of their size); its tensors' bytes within `limit`."""
    _check_request(request, inputs)
    total, binary, seen = 0, 0, set()
    for n, tensor in enumerate(request["inputs"]):
        size, part = _check_tensor(n, tensor, limit, inputs, seen)
        total, binary = total + size, binary + part
    if binary != binary_bytes:
        raise RequestRefused(400, f"the request's binary parts add up to {binary} bytes and {binary_bytes} follow "
                                  "its JSON header (Inference-Header-Content-Length)")
    if total > limit:
        raise RequestRefused(413, f"the request's tensors take {total} bytes, more than a request may carry ({limit} "
                                  "bytes; serve --max-request-mb)")


def _check_request(request: dict, inputs: dict | None) -> None:
    """The request's own fields: an "inputs" list, its outputs named, no input of the model sent as a parameter."""
    if not isinstance(request, dict) or not isinstance(request.get("inputs"), list) or not request["inputs"]:
        raise RequestRefused(400, 'an infer request is a JSON object whose "inputs" lists the tensors sent: '
                                  '{"inputs": [{"name", "shape", "datatype", "data"}]}')
    _check_fields(request, "the request")
    for n, output in enumerate(request.get("outputs") or []):
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise RequestRefused(400, f'output {n + 1} is not an object with a "name"')
        _check_fields(output, f"output {output['name']!r}")
    parameters = request.get("parameters") or {}
    misplaced = sorted(set(parameters) & set(inputs or ()))
    if misplaced:  # the models read inputs only: a request parameter of an input's name would be ignored silently
        raise RequestRefused(400, f"{', '.join(misplaced)} is an input of this model, not a request parameter; send "
                                  f"it in \"inputs\" ({', '.join(f'{m} {inputs[m][0]}' for m in misplaced)} [1, 1])")


def _check_tensor(n: int, tensor, limit: int, inputs: dict | None, seen: set) -> tuple[int, int]:
    """Input n's header (its name added to `seen`). Returns (its bytes, the bytes of its binary part)."""
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise RequestRefused(400, f"input {n + 1} is not an object with a \"name\"")
    name, dtype, shape = tensor["name"], tensor.get("datatype"), tensor.get("shape")
    _check_fields(tensor, f"input {name!r}")
    if name in seen:
        raise RequestRefused(400, f"input {name!r} is given twice; send each input once")
    seen.add(name)
    _check_declared(name, dtype, shape, inputs)
    count = _count(shape)
    size = (ELEMENT_BYTES[dtype] or 1) * count
    if size > limit:
        raise RequestRefused(413, f"input {name!r}: shape {shape} holds {count} values, more than a request may "
                                  f"carry ({limit} bytes; serve --max-request-mb)")
    parameters = tensor.get("parameters") or {}
    if "binary_data_size" in parameters:
        part = parameters["binary_data_size"]
        if not isinstance(part, int) or isinstance(part, bool) or part < 0:
            raise RequestRefused(400, f"input {name!r}: binary_data_size must be a whole number >= 0")
        if ELEMENT_BYTES[dtype] is not None and part != size:
            raise RequestRefused(400, f"input {name!r}: shape {shape} of {dtype} takes {size} bytes, its binary "
                                      f"part has {part}")
        return part, part
    if "data" not in tensor:
        raise RequestRefused(400, f"input {name!r} has no \"data\" (nor a binary part)")
    if not isinstance(tensor["data"], list):  # Triton reads data as an array, a scalar is its 500
        raise RequestRefused(400, f"input {name!r}: data must be a list of values (or of rows), got "
                                  f"{type(tensor['data']).__name__}")
    values = _leaves(tensor["data"], name)
    if len(values) != count:
        raise RequestRefused(400, f"input {name!r}: shape {shape} holds {count} values, its data {len(values)}")
    _check_values(values, dtype, name)
    return (size if dtype != "BYTES" else sum(len(v.encode("utf-8")) + 4 for v in values)), 0


def _check_declared(name: str, dtype, shape, inputs: dict | None) -> None:
    """An input's name, datatype and shape: Triton's datatypes, whole dims >= 0, and the model's (when known)."""
    if inputs is not None and name not in inputs:
        raise RequestRefused(400, f"unknown input {name!r}; this model takes {', '.join(sorted(inputs))}")
    if dtype not in ELEMENT_BYTES:
        raise RequestRefused(400, f"input {name!r} has datatype {dtype!r}; give one of Triton's: "
                                  f"{', '.join(ELEMENT_BYTES)}")
    if inputs is not None and dtype != inputs[name][0]:
        raise RequestRefused(400, f"input {name!r} is {inputs[name][0]}, not {dtype}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise RequestRefused(400, f"input {name!r}: shape must be a list of whole numbers >= 0, got "
                                  f"{json.dumps(shape)}")
    if inputs is not None and len(shape) != len(inputs[name][1]) + 1:
        raise RequestRefused(400, f"input {name!r} has shape {shape}; it takes [batch, "
                                  f"{', '.join(map(str, inputs[name][1]))}] (-1: any length)")


def screen(method: str, path: str, headers, body: bytes, limit: int, models: dict[str, dict] | None) -> bytes:
    """The body to forward for a request (decompressed, when it came gzip- or deflate-encoded), or RequestRefused.
    An infer request (POST /v2/models/M[/versions/V]/infer) is checked whole (`check_inputs`); any other JSON body
    for being JSON."""
    encoding = (headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding in ("gzip", "deflate"):
        inflater = zlib.decompressobj(zlib.MAX_WBITS | 32 if encoding == "gzip" else zlib.MAX_WBITS)
        try:
            body = inflater.decompress(body, limit + 1)
        except zlib.error as exc:
            raise RequestRefused(400, f"the request body is not valid {encoding} data ({exc})") from None
        if len(body) > limit or inflater.unconsumed_tail:
            raise RequestRefused(413, f"the request body inflates past {limit} bytes (serve --max-request-mb)")
    elif encoding != "identity":
        raise RequestRefused(400, f"Content-Encoding {encoding!r} is not offered; send gzip, deflate or none")
    if not body:
        return body
    parts = path.split("?")[0].strip("/").split("/")
    infer = method == "POST" and len(parts) in (4, 6) and parts[:2] == ["v2", "models"] and parts[-1] == "infer"
    header = headers.get("Inference-Header-Content-Length")
    if header is not None:
        if not header.strip().isdigit() or int(header) > len(body):
            raise RequestRefused(400, f"Inference-Header-Content-Length must be a whole number of bytes within the "
                                      f"body's {len(body)}, got {header!r}")
        head, binary = body[: int(header)], len(body) - int(header)
    else:
        head, binary = body, 0
    document = parse_json(head)
    if infer:
        known = (models or {}).get(parts[2])
        check_inputs(document, binary, limit, known)
    return body


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "HttpGuard"
    # An answer leaves in one write (buffered, flushed after each request) on a socket without Nagle's delay: headers
    # and body written apart waited for the client's delayed ACK, 40 ms a request (benchmarks/README.md).
    wbufsize = -1
    disable_nagle_algorithm = True

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        logger.debug("%s " + format, self.client_address[0], *args)

    def _refuse(self, status: int, message: str, close: bool = False) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> bytes | None:
        """The request's body, read whole; None when it was refused (the answer sent)."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self._refuse(411, "send the request with a Content-Length (chunked bodies are not taken)", close=True)
            return None
        length = self.headers.get("Content-Length") or "0"
        if not length.strip().isdigit():
            self._refuse(400, f"Content-Length must be a whole number of bytes, got {length!r}", close=True)
            return None
        if int(length) > self.server.limit:
            self._refuse(413, f"the request body is {int(length)} bytes, more than a request may carry "
                              f"({self.server.limit} bytes; serve --max-request-mb); send audio as file bytes "
                              "(the binary tensor extension) or in pieces", close=True)
            return None
        return self.rfile.read(int(length))

    def _forward(self) -> None:
        body = self._body()
        if body is None:
            return
        try:
            body = screen(self.command, self.path, self.headers, body, self.server.limit, self.server.models)
        except RequestRefused as exc:
            self._refuse(exc.status, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a fault of this front: answered (and logged), not a dropped client
            logger.exception("serve's HTTP front failed on %s %s", self.command, self.path)
            self._refuse(500, f"internal error in serve's HTTP front: {type(exc).__name__}: {exc}")
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        try:
            status, reason, answer_headers, answer = self.server.upstream(self.command, self.path, body, headers)
        except (OSError, http.client.HTTPException) as exc:
            self._refuse(503, f"the inference server is not answering ({exc}); it may be stopping")
            return
        self.send_response(status, reason)
        for key, value in answer_headers:
            if key.lower() not in _HOP:
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(answer)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _forward


class HttpGuard(ThreadingHTTPServer):
    """The front on (host, port), forwarding what passes to Triton's HTTP endpoint at 127.0.0.1:`upstream_port`.
    `models`: {model: {input: (datatype, dims)}} of the served models (None: names and shapes not checked).
    `serve_forever` in a thread of its own (`start`); `stop` closes it."""

    daemon_threads = True
    allow_reuse_address = True
    # The listen backlog (socketserver's default: 5). Clients connect in bursts (a pool of 24 at once); past the
    # backlog the kernel drops their SYNs and they retry a second later, by when a SIGTERM may have closed Triton's
    # HTTP endpoint to new connections: requests sent before the drain refused (503). The kernel caps it at
    # net.core.somaxconn.
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], upstream_port: int, limit: int, models: dict | None = None):
        super().__init__(address, _Handler)
        self.upstream_port, self.limit, self.models = upstream_port, limit, models
        self._local = threading.local()
        self._thread: threading.Thread | None = None

    def upstream(self, method: str, path: str, body: bytes, headers: dict):
        """(status, reason, headers, body) of Triton's answer; one kept-alive connection a handler thread."""
        for attempt in (0, 1):
            connection = getattr(self._local, "connection", None)
            if connection is None:
                connection = self._local.connection = http.client.HTTPConnection("127.0.0.1", self.upstream_port,
                                                                                  timeout=3600)
            try:
                connection.request(method, path, body=body if body or method in ("POST", "PUT") else None,
                                   headers=headers)
                answer = connection.getresponse()
                return answer.status, answer.reason, answer.getheaders(), answer.read()
            except (OSError, http.client.HTTPException):
                connection.close()
                self._local.connection = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def start(self) -> "HttpGuard":
        self._thread = threading.Thread(target=self.serve_forever, name="seq2trt-http-guard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
