"""The demo's prompts, shared by the demo run and the bench's real-model section."""

DEMO_PROMPTS = [
    "def main(argv=None):\n",
    "import os\nimport sys\n\n",
    "class Config:\n    def __init__(self, ",
    "    for i in range(len(",
    "# Copyright",
    "    def __repr__(self):\n        return ",
    "if __name__ == '__main__':\n",
    "    except ValueError:\n",
]
