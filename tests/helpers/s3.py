"""A local S3 server (moto) for the object-storage tests: `with S3Server() as s3: s3.endpoint`.

Listens on 127.0.0.1 only, holds one bucket, and is stopped by its PID on exit. The dummy
credentials it needs are in `CREDENTIALS`; `with` puts them in this process's environment (and
takes them out again) so that clients started from here inherit them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

BUCKET = "pipeline-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    def __init__(self, bucket: str = BUCKET):
        self.bucket, self.endpoint, self.proc, self.saved = bucket, "", None, {}

    def __enter__(self) -> "S3Server":
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        self.saved = {k: os.environ.get(k) for k in CREDENTIALS}
        os.environ.update(CREDENTIALS)
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.time() > deadline or self.proc.poll() is not None:
                        raise RuntimeError("the moto S3 server did not start") from None
                    time.sleep(0.2)
            from pyarrow import fs

            fs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http",
                            allow_bucket_creation=True).create_dir(self.bucket)
        except BaseException:
            self.__exit__()
            raise
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    def store(self, prefix: str):
        from pipeline.storage import ObjectStore

        return ObjectStore(f"s3://{self.bucket}/{prefix}", self.endpoint)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
