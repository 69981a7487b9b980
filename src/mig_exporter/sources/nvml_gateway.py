"""The only module that touches pynvml: one gateway for every NVML call.

NVML is initialised once and re-initialised after a driver-level error (the
driver was reloaded or upgraded under us). Every call goes through
``Nvml.call``, which turns pynvml's exceptions into ``NvmlCallError`` carrying
the NVML error name, so callers can decide per call what a failure means
(an empty MIG slot, an unsupported reading, a lost card).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from mig_exporter.core.errors import ReadError

T = TypeVar("T")

# Errors after which the library must be initialised again before the next call.
_REINIT_ERRORS = frozenset({
    pynvml.NVML_ERROR_UNINITIALIZED,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
})
# Errors that mean "this reading does not exist here", not a failure.
UNSUPPORTED = frozenset({
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_NO_DATA,
})
# Errors that mean the card as a whole cannot be read now.
CARD_FAILURES = frozenset({
    pynvml.NVML_ERROR_GPU_IS_LOST,
    pynvml.NVML_ERROR_NO_PERMISSION,
    pynvml.NVML_ERROR_UNKNOWN,
    pynvml.NVML_ERROR_RESET_REQUIRED,
    pynvml.NVML_ERROR_TIMEOUT,
    pynvml.NVML_ERROR_IRQ_ISSUE,
    pynvml.NVML_ERROR_CORRUPTED_INFOROM,
})
# Of those, the errors that say the card (or the library) is gone, whichever reading asked: a
# reading that only concerns itself (NO_PERMISSION on one counter, an InfoROM's aggregate ECC
# corrupted) leaves the rest of the card readable.
CARD_GONE = frozenset({
    pynvml.NVML_ERROR_GPU_IS_LOST,
    pynvml.NVML_ERROR_RESET_REQUIRED,
    pynvml.NVML_ERROR_TIMEOUT,
    pynvml.NVML_ERROR_IRQ_ISSUE,
}) | _REINIT_ERRORS
# Answers that stay true while the library stays loaded and the card's mode stays the same.
LASTING_UNSUPPORTED = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})


# Raised by pynvml's unversioned wrappers when the driver lacks the version
# they call; not an NVMLError. Absent from older nvidia-ml-py releases.
_LIBRARY_MISMATCH: type[Exception] = getattr(pynvml, "NVMLLibraryMismatchError", pynvml.NVMLError)


class NvmlUnavailable(ReadError):
    """libnvidia-ml could not be loaded or initialised."""


class NvmlCallError(ReadError):
    """One NVML call failed; ``code`` is the NVML return code."""

    def __init__(self, function: str, code: int, message: str) -> None:
        super().__init__(f"{function}: {message}")
        self.function = function
        self.code = code

    @property
    def unsupported(self) -> bool:
        return self.code in UNSUPPORTED

    @property
    def card_gone(self) -> bool:
        return self.code in CARD_GONE


def error_name(code: int) -> str:
    """``NVML_ERROR_GPU_IS_LOST`` for 15, and so on."""
    for name in dir(pynvml):
        if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == code:
            return name
    return f"NVML error {code}"


class Nvml:
    """A handle on libnvidia-ml, initialised on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Held across an initialisation and the hooks run before it (``on_reinit``): apart from
        # ``_lock``, which a hook's own failing call takes (``_failed``) while a read may hold the
        # hook's lock and wait for ``_lock``.
        self._init_lock = threading.Lock()
        self._before_reinit: list[Callable[[], None]] = []
        self._initialised = False
        # Counts initialisations: what was learnt of the library (an unsupported call) holds
        # until the next one, which may be a reloaded or upgraded driver.
        self.generation = 0

    def on_reinit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` before NVML is initialised again (after a driver-level error), whoever
        asks for it first: a read, or a readiness check. What it frees belongs to the old
        initialisation, and must go before the new one hands out its own."""
        self._before_reinit.append(callback)

    def ensure(self) -> None:
        """Initialise if needed. Raises ``NvmlUnavailable`` with the reason."""
        if self._initialised:
            return
        with self._init_lock:
            with self._lock:
                if self._initialised:
                    return
                again = self.generation > 0
            if again:
                for callback in self._before_reinit:
                    callback()
            with self._lock:
                try:
                    pynvml.nvmlInit()
                except pynvml.NVMLError as e:
                    raise NvmlUnavailable(f"NVML cannot be initialised: {_describe(e)}") from None
                except OSError as e:  # the shared library itself would not load
                    raise NvmlUnavailable(f"libnvidia-ml cannot be loaded: {e}") from None
                self._initialised = True
                self.generation += 1

    def shutdown(self) -> None:
        with self._lock:
            if self._initialised:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlShutdown()
                self._initialised = False

    def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call one pynvml function. Every NVML call in the exporter comes here."""
        try:
            return function(*args, **kwargs)
        except UnicodeDecodeError as e:
            # pynvml decodes the names it returns strictly; a process name that
            # is not UTF-8 must not fail the read: keep it, with replacements
            # (a str, the T of the only calls that decode).
            return e.object.decode("utf-8", errors="replace")  # type: ignore[return-value]
        except _LIBRARY_MISMATCH as e:  # pynvml's own "this symbol's version is missing"
            raise NvmlCallError(getattr(function, "__name__", "nvml"), pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                                f"NVML_ERROR_FUNCTION_NOT_FOUND ({e})") from None
        except pynvml.NVMLError as e:
            raise self._failed(getattr(function, "__name__", "nvml"), e) from None

    def c_function(self, name: str) -> Any:
        """The library's C function ``name``, through pynvml's own lookup and cache, for the hot
        calls whose pynvml wrapper builds a Python object per entry; its codes go to ``check``.
        A symbol the library lacks raises ``NvmlCallError`` (FUNCTION_NOT_FOUND) naming it."""
        try:
            return pynvml._nvmlGetFunctionPointer(name)
        except pynvml.NVMLError as e:
            raise self._failed(name, e) from None

    def uint(self, name: str, handle: Any) -> int:
        """``name(device, unsigned int *)`` (``nvmlDeviceGetGpuInstanceId``...), as pynvml's
        wrapper calls it, without its Python layers: these are asked per MIG device."""
        value = ctypes.c_uint()
        self.check(name, self.c_function(name)(handle, ctypes.byref(value)))
        return value.value

    def text(self, name: str, handle: Any, size: int) -> bytes:
        """``name(device, char *, unsigned int)`` (``nvmlDeviceGetName``, ``GetUUID``), likewise."""
        buffer = ctypes.create_string_buffer(size)
        self.check(name, self.c_function(name)(handle, buffer, ctypes.c_uint(size)))
        return buffer.value

    def mig_handle(self, handle: Any, index: int) -> Any:
        """``nvmlDeviceGetMigDeviceHandleByIndex``, likewise."""
        name = "nvmlDeviceGetMigDeviceHandleByIndex"
        mig = pynvml.c_nvmlDevice_t()
        self.check(name, self.c_function(name)(handle, ctypes.c_uint(index), ctypes.byref(mig)))
        return mig

    def check(self, name: str, code: int) -> None:
        """What ``call`` does with a failing pynvml call, for a return code of ``c_function``'s."""
        if code != pynvml.NVML_SUCCESS:
            raise self._failed(name, pynvml.NVMLError(code))

    def _failed(self, name: str, e: pynvml.NVMLError) -> NvmlCallError:
        code = int(getattr(e, "value", pynvml.NVML_ERROR_UNKNOWN))
        if code in _REINIT_ERRORS:
            with self._lock:
                self._initialised = False  # the next read initialises again
        return NvmlCallError(name, code, _describe(e))

    def optional(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """Like ``call``, but a reading the device does not have is ``None``."""
        try:
            return self.call(function, *args, **kwargs)
        except NvmlCallError as e:
            if e.unsupported:
                return None
            raise


def _describe(e: pynvml.NVMLError) -> str:
    code = int(getattr(e, "value", pynvml.NVML_ERROR_UNKNOWN))
    try:
        text = str(e)
    except Exception:  # nvmlErrorString itself can fail on a broken library
        text = ""
    name = error_name(code)
    return f"{name} ({text})" if text and text != name else name
