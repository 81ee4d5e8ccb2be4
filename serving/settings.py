"""The settings of one `seq2trt serve` run (its flags), read by the server's checks, the model repository it writes
(`serving.model_config`) and the tritonserver command line (`serving.process`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from seq2trt.reference_model.decoding import GNMT_ALPHA


@dataclass(frozen=True)
class ServeSettings:
    out: Path
    backend: str = "ort-fused"
    checkpoint: Path | None = None
    threads: int = 1
    max_batch: int | None = None  # requests per server batch; None: the export's max_batch
    max_queue_delay_us: int = 2000
    instances: int = 1
    alpha: float = GNMT_ALPHA
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    # The largest HTTP request body (MiB) serve's front takes (serving.http_guard): later Triton releases' own
    # --http-max-input-size default: 64 MiB of JSON floats (8-20 bytes each) is 3.5-9 min of 16 kHz samples, of a
    # 16-bit WAV file 35 min (docs/serving-limits.md).
    max_request_mb: float = 64.0

    def endpoints(self) -> dict[str, str]:
        return {"http": f"http://{self.host}:{self.http_port}", "grpc": f"grpc://{self.host}:{self.grpc_port}",
                "metrics": f"http://{self.host}:{self.metrics_port}/metrics"}
