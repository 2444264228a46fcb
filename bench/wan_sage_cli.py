"""The pack's command-line tool run from this checkout, whatever its folder is called:
``python -m bench.wan_sage_cli bench ...`` is ``wan-sage bench ...`` without installing the package."""
import sys

from . import _host


def main(argv=None) -> int:
    _host.load_pack()
    from wan_sage.cli import main as cli_main
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
