# The Device Companion server as a container image: a static binary on
# scratch, run as an unprivileged user, its state in the /data volume.
#
#   docker build -f packaging/docker/companion.Dockerfile \
#     --build-arg VERSION=$(git describe --always --dirty) -t companion .
#   docker run --stop-timeout 90 -p 8080:8080 -p 1883:1883 -v companion-data:/data companion
#
# --stop-timeout 90: docker stop's default, 10 s, is shorter than the
# server's shutdown (15 s for the requests in flight, a minute at most
# before it says what holds it and exits); give the same to Compose
# (stop_grace_period: 90s) and Kubernetes (terminationGracePeriodSeconds:
# 90). Bug 408.
#
# Flags come as COMPANION_<FLAG> variables (docker run -e) or as arguments
# after the image name (they replace "serve", so start with it). There is no
# HEALTHCHECK: scratch has no shell or HTTP client to run one with; let the
# orchestrator probe GET /healthz and GET /readyz on port 8080 (Kubernetes
# httpGet probes, or a load balancer's checks) instead.
#
# Multi-platform: docker buildx build --platform linux/amd64,linux/arm64,linux/arm/v7
# cross-compiles on the build machine's own platform.

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
    go build -trimpath -ldflags "-s -w -X main.version=$VERSION" -o /out/companion ./cmd/companion \
 && mkdir -p /out/data

FROM scratch
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build --chown=65532:65532 /out/data /data
COPY --from=build /out/companion /usr/local/bin/companion
# nonroot: no account file is needed for a numeric user.
USER 65532:65532
ENV COMPANION_HTTP=0.0.0.0:8080 \
    COMPANION_MQTT_LISTEN=0.0.0.0:1883 \
    COMPANION_DATA=/data
VOLUME /data
# HTTP API, the embedded MQTT broker, and --metrics when it is set to :9464.
EXPOSE 8080 1883 9464
ENTRYPOINT ["/usr/local/bin/companion"]
CMD ["serve"]
