# The Device Companion bridge as a container image: a static binary on
# scratch, run as an unprivileged user, its spool in the /data volume.
#
#   docker build -f packaging/docker/companion-bridge.Dockerfile \
#     --build-arg VERSION=$(git describe --always --dirty) -t companion-bridge .
#   docker run -v bridge-data:/data \
#     -e COMPANION_MQTT_URL=tcp://broker:1883 -e COMPANION_API_URL=http://server:8080 \
#     -e COMPANION_BRIDGE_ID=bridge-1 -e COMPANION_BRIDGE_SECRET=… \
#     -e COMPANION_SIM_DEVICES=sim-001 companion-bridge
#
# With --gatt bluez the bridge reaches BlueZ over the host's system D-Bus:
# mount its socket (-v /run/dbus/system_bus_socket:/run/dbus/system_bus_socket);
# no device node, capability or host network is needed. The bridge listens
# on nothing by default (EXPOSE none), and scratch has no shell or client to
# run a HEALTHCHECK with. To watch it, give it --metrics
# (-e COMPANION_METRICS=0.0.0.0:9465 -p 9465:9465) and alert on
# companion_bridge_mqtt_connected == 0 (docs/operations.md), or watch the
# server's companion_bridges_away. Its retained state topic
# (companion/v1/bridges/ID/state) is the server's alone: no user may
# subscribe to it (README, bug 409).

ARG GO_IMAGE=docker.io/library/golang:1.26-bookworm

FROM --platform=$BUILDPLATFORM ${GO_IMAGE} AS build
# BuildKit's automatic platform arguments, without defaults: an ARG's own
# default wins over BuildKit's value, and TARGETARCH=amd64 built an amd64
# binary into the arm64 and arm/v7 images (bug 403). Without BuildKit
# they are empty, and the binary is for the build machine.
ARG TARGETOS TARGETARCH TARGETVARIANT
ARG VERSION=devel
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 GOOS=${TARGETOS:-linux} GOARCH=${TARGETARCH:-$(go env GOARCH)} GOARM=${TARGETVARIANT#v} \
    go build -trimpath -ldflags "-s -w -X main.version=$VERSION" -o /out/companion-bridge ./cmd/companion-bridge \
 && mkdir -p /out/data

FROM scratch
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build --chown=65532:65532 /out/data /data
COPY --from=build /out/companion-bridge /usr/local/bin/companion-bridge
USER 65532:65532
ENV COMPANION_DATA=/data
VOLUME /data
ENTRYPOINT ["/usr/local/bin/companion-bridge"]
