"""hkstore must import and work where torch is not installed."""

import subprocess
import sys
import textwrap


def test_store_and_cli_work_without_torch(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import numpy as np
        import hkstore
        from click.testing import CliRunner
        from tools.cli import main
        st = hkstore.create({str(tmp_path / "s")!r}, d=4, vocab_size=5)
        uni = np.zeros((5, 3), dtype=np.uint32); uni[:, 1] = np.arange(5)
        st.add_segment("root", uni, np.ones((5, 3, 4)))
        st.close()
        for args in (["verify", {str(tmp_path / "s")!r}], ["tree", {str(tmp_path / "s")!r}],
                     ["lookup", {str(tmp_path / "s")!r}, "--ids", "1,2"], ["--help"]):
            r = CliRunner().invoke(main, args)
            assert r.exit_code == 0, (args, r.output)
        assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=str(__import__("pathlib").Path(__file__).parent.parent))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
