"""Start a real ComfyUI server on the CPU (127.0.0.1, free port) with this pack and, when
available, ComfyUI-GGUF installed as custom nodes, and placeholder model files for every model
name the example workflows use.  Used by the HTTP route tests and the browser test."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIRS = ("diffusion_models", "unet", "loras", "vae", "text_encoders", "clip", "clip_vision", "checkpoints")
MODEL_EXT = re.compile(r"\.(safetensors|gguf|pt|pth|ckpt|bin|sft)$")


def gguf_path(comfy_path: str) -> str | None:
    p = os.environ.get("COMFYUI_GGUF_PATH") or str(Path(comfy_path).parent / "ComfyUI-GGUF")
    return p if Path(p, "nodes.py").is_file() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_names() -> set:
    names = set()
    for wf in (ROOT / "example_workflows").glob("*.json"):
        for node in json.loads(wf.read_text()).get("nodes", []):
            for v in node.get("widgets_values") or []:
                if isinstance(v, str) and MODEL_EXT.search(v):
                    names.add(v)
    return names


class Server:
    def __init__(self, work: Path, comfy_path: str, with_gguf: bool = True, with_pack: bool = True,
                 extra_args: tuple = ()):
        self.work = Path(work)
        self.comfy = comfy_path
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cn = self.work / "custom_nodes"
        cn.mkdir(parents=True, exist_ok=True)
        if with_pack:
            (cn / "wan-sage").symlink_to(ROOT, target_is_directory=True)
        g = gguf_path(comfy_path) if with_gguf else None
        if g:
            (cn / "ComfyUI-GGUF").symlink_to(Path(g).resolve(), target_is_directory=True)
        self.has_gguf = bool(g)
        models = self.work / "models"
        for d in MODEL_DIRS:
            (models / d).mkdir(parents=True, exist_ok=True)
            for n in _model_names():
                (models / d / n).write_bytes(b"")
        cfg = self.work / "extra_model_paths.yaml"
        cfg.write_text("wan_sage_test:\n    base_path: %s\n    custom_nodes: %s\n" % (models, cn)
                       + "".join(f"    {d}: {d}\n" for d in MODEL_DIRS))
        for d in ("out", "temp", "user", "input"):
            (self.work / d).mkdir(exist_ok=True)
        self.log = open(self.work / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
             "--extra-model-paths-config", str(cfg), "--output-directory", str(self.work / "out"),
             "--temp-directory", str(self.work / "temp"), "--user-directory", str(self.work / "user"),
             "--input-directory", str(self.work / "input"), "--disable-auto-launch", *extra_args],
            cwd=comfy_path, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait(self, timeout: float = 180.0) -> "Server":
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/system_stats", timeout=2) as r:
                    if r.status == 200:
                        return self
            except Exception:
                time.sleep(0.5)
        raise TimeoutError(f"ComfyUI did not answer within {timeout} s:\n{self.log_text()[-4000:]}")

    def log_text(self) -> str:
        self.log.flush()
        return (self.work / "server.log").read_text(errors="replace")

    def request(self, method: str, path: str, body=None, raw: bytes | None = None):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
