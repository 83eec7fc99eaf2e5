import sys
from pathlib import Path

# Under --import-mode=importlib test modules are not on sys.path: let them
# share prefix_cache_strategies.
sys.path.insert(0, str(Path(__file__).parent))
