"""chunkledger pipelines: the Beam cache builder."""

import logging


class _BeamWithoutGcp(logging.Filter):
    """Apache Beam logs a WARNING on import when its GCP extra (apitools) is not installed, although nothing
    here uses BigQuery: a routine build would start with a warning there is nothing to do about. This drops
    that one record (installed before any Beam import: every process of a build imports this package first),
    and the handler ``logging.warning`` added to the unconfigured root logger only to print it: left there, it
    would keep logging's default format and the stderr of the moment, and the builder's console (which
    configures logging later) would lose its own warnings."""

    NOTICE = "apitools not found, and bigquery client libraries are not available"

    def __init__(self):
        super().__init__()
        self.had = set(logging.getLogger().handlers)

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.name == "root" and str(record.msg).startswith(self.NOTICE)):
            return True
        root = logging.getLogger()
        for h in root.handlers[:]:
            if h not in self.had and type(h) is logging.StreamHandler and h.formatter is not None \
                    and h.formatter._fmt == logging.BASIC_FORMAT:  # what logging.basicConfig() makes
                root.removeHandler(h)
        return False


if not any(isinstance(f, _BeamWithoutGcp) for f in logging.getLogger().filters):
    logging.getLogger().addFilter(_BeamWithoutGcp())
