"""pytest marks shared by the DataLoader tests (kept apart from common.py, which worker processes import)."""

import pytest

# torch's hint for more DataLoader workers than cores, and torchdata calling a deprecated torch function
DATALOADER_WARNINGS = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
                       pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]
