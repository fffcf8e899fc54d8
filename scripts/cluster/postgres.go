package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/devicecompanion/companion/internal/pgctl"
)

// pgUser and pgDatabase are the superuser initdb makes and the database the
// replicas share.
const (
	pgUser     = "companion"
	pgDatabase = "companion"
)

// pgServer is the cluster's PostgreSQL: DIR/postgres/data, made by initdb,
// on 127.0.0.1:port.
type pgServer struct {
	port int
	dsn  string // postgres://companion:PASSWORD@127.0.0.1:PORT/companion?sslmode=disable
}

// startPostgres makes a data directory with initdb (pgctl.InitDB: UTF8,
// locale C, the superuser pgUser with a random password, scram-sha-256),
// starts the server on c.pg.port with TCP only, waits until it answers and
// creates the database. PostgreSQL refuses to run as root: when this
// program runs as root, initdb and the server run as the system user
// postgres, which Debian's package makes (pgctl.Credential).
func (c *cluster) startPostgres(ctx context.Context) error {
	bin, err := pgctl.Bin()
	if err != nil {
		return err
	}
	cred, err := pgctl.Credential()
	if err != nil {
		return err
	}
	home := filepath.Join(c.dir, "postgres")
	if err := os.Mkdir(home, 0o700); err != nil {
		return err
	}
	password := randomString(18)
	if err := pgctl.InitDB(ctx, bin, home, pgUser, password, cred); err != nil {
		return err
	}

	p, err := c.spawn("postgres", cred, filepath.Join(bin, "postgres"),
		"-D", filepath.Join(home, "data"),
		"-p", strconv.Itoa(c.pg.port),
		"-c", "listen_addresses=127.0.0.1",
		"-c", "unix_socket_directories=", // TCP only: no socket path to get too long or to share
		"-c", "logging_collector=off",
	)
	if err != nil {
		return err
	}
	admin := pgctl.URL(c.pg.port, pgUser, password, "postgres")
	if err := c.waitFor(ctx, p, "PostgreSQL", func() error { return pgExec(ctx, admin, "SELECT 1") }); err != nil {
		return err
	}
	if err := pgExec(ctx, admin, "CREATE DATABASE "+pgDatabase); err != nil {
		return fmt.Errorf("create database: %w", err)
	}
	c.pg.dsn = pgctl.URL(c.pg.port, pgUser, password, pgDatabase)
	return nil
}

// pgExec connects to dsn, runs sql and disconnects.
func pgExec(ctx context.Context, dsn, sql string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, sql)
	return err
}
