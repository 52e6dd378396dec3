import logging

__version__ = "0.1.0"


class _NoCpuAcceleratorNotice(logging.Filter):
    """DeepSpeed (installed with the dev extra; accelerate imports it whenever it is present) warns on every import
    on a machine without a GPU that it "set the accelerator to CPU": true of every CPU run of dlm, so not shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Setting accelerator to CPU" not in record.getMessage()


logging.getLogger("DeepSpeed").addFilter(_NoCpuAcceleratorNotice())
